//! The Confluent wire format: a magic byte 0, the schema id as a 4-byte
//! big-endian integer, then (Protobuf only) the message indexes, then the
//! encoded record.
//!
//! | Bytes | Meaning |
//! |---|---|
//! | `0x00` | magic byte; anything else is not this format |
//! | 4 | schema id, big-endian, as the registry assigned it |
//! | varints | Protobuf only: how many message indexes, then each, all zigzag varints; a single `0` byte stands for `[0]` (the file's first message) |
//! | rest | the Avro datum, the Protobuf message, or the JSON text |

/// The most message indexes a payload may carry: messages nested deeper
/// than this are refused rather than read (a hostile count must not
/// allocate).
const MAX_INDEXES: usize = 64;

/// The schema id and the bytes after it.
pub(crate) fn split(payload: &[u8]) -> Result<(u32, &[u8]), String> {
    match payload {
        [0, a, b, c, d, body @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), body)),
        [0, ..] => Err(format!(
            "the payload is {} bytes, shorter than the 5-byte schema registry header",
            payload.len()
        )),
        [magic, ..] => Err(format!(
            "unknown magic byte {magic:#04x}: not in the schema registry wire format (magic byte 0)"
        )),
        [] => Err("the payload is empty: no schema registry header".to_owned()),
    }
}

/// The Protobuf message indexes at the start of `body`, and the message
/// after them.
pub(crate) fn message_indexes(body: &[u8]) -> Result<(Vec<usize>, &[u8]), String> {
    let (count, mut rest) = zigzag(body)?;
    if count == 0 {
        return Ok((vec![0], rest));
    }
    let count = usize::try_from(count)
        .ok()
        .filter(|n| *n <= MAX_INDEXES)
        .ok_or_else(|| format!("{count} Protobuf message indexes: at most {MAX_INDEXES}"))?;
    let mut indexes = Vec::with_capacity(count);
    for _ in 0..count {
        let (index, after) = zigzag(rest)?;
        let index = usize::try_from(index)
            .map_err(|_| format!("negative Protobuf message index {index}"))?;
        indexes.push(index);
        rest = after;
    }
    Ok((indexes, rest))
}

/// One zigzag-encoded varint (at most 10 bytes) and the bytes after it.
fn zigzag(bytes: &[u8]) -> Result<(i64, &[u8]), String> {
    let mut raw: u64 = 0;
    for (i, byte) in bytes.iter().enumerate().take(10) {
        raw |= u64::from(byte & 0x7F) << (7 * i);
        if byte & 0x80 == 0 {
            let value = (raw >> 1) as i64 ^ -((raw & 1) as i64);
            return Ok((value, &bytes[i + 1..]));
        }
    }
    Err("truncated or overlong varint in the Protobuf message indexes".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_gives_the_id_and_the_body() {
        assert_eq!(split(b"\0\0\0\x01\x02rest"), Ok((258, &b"rest"[..])));
        assert_eq!(split(b"\0\0\0\0\x07"), Ok((7, &b""[..])));
    }

    #[test]
    fn other_magic_short_and_empty_payloads_are_refused() {
        assert!(
            split(b"\x01\0\0\0\x01x")
                .unwrap_err()
                .contains("magic byte 0x01")
        );
        assert!(split(b"{\"a\":1}").unwrap_err().contains("magic byte 0x7b"));
        assert!(split(b"\0\0\x01").unwrap_err().contains("shorter"));
        assert!(split(b"").unwrap_err().contains("empty"));
    }

    #[test]
    fn indexes_follow_confluent() {
        // [0] is the single byte 0; [1] is count 1 then 1; [1, 1] is count 2.
        assert_eq!(message_indexes(b"\x00msg"), Ok((vec![0], &b"msg"[..])));
        assert_eq!(message_indexes(b"\x02\x02msg"), Ok((vec![1], &b"msg"[..])));
        assert_eq!(
            message_indexes(b"\x04\x02\x02m"),
            Ok((vec![1, 1], &b"m"[..]))
        );
        // 70 is zigzag 140 = 0x8c 0x01.
        assert_eq!(message_indexes(b"\x02\x8c\x01"), Ok((vec![70], &b""[..])));
    }

    #[test]
    fn hostile_indexes_are_refused_without_allocating() {
        assert!(
            message_indexes(b"\x80\x80\x80\x80\x10")
                .unwrap_err()
                .contains("at most")
        );
        assert!(
            message_indexes(b"\x01").unwrap_err().contains("at most"),
            "count -1"
        );
        assert!(
            message_indexes(b"\x02\x01")
                .unwrap_err()
                .contains("negative")
        );
        assert!(
            message_indexes(b"\x04\x02")
                .unwrap_err()
                .contains("truncated")
        );
        assert!(
            message_indexes(&[0xFF; 11])
                .unwrap_err()
                .contains("overlong")
        );
    }
}
