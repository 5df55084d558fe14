use super::*;

fn json(body: &str) -> Delivery {
    Delivery::new(body.as_bytes().to_vec())
}

#[test]
fn header_key_is_taken_verbatim_and_case_insensitively() {
    let d = json("{}").with_metadata("idempotency-key", "abc-123");
    let key = KeySpec::header("Idempotency-Key").derive(&d).unwrap();
    assert_eq!(key.as_str(), "abc-123");
}

#[test]
fn header_key_errors_are_precise() {
    let spec = KeySpec::header("Idempotency-Key");
    assert_eq!(
        spec.derive(&json("{}")),
        Err(KeyError::MissingMetadata {
            name: "Idempotency-Key".into()
        })
    );
    let d = json("{}").with_metadata("Idempotency-Key", b"\xff\xfe".to_vec());
    assert_eq!(spec.derive(&d), Err(KeyError::NotUtf8));
    let d = json("{}").with_metadata("Idempotency-Key", "");
    assert_eq!(spec.derive(&d), Err(KeyError::Empty));
    let d = json("{}").with_metadata("Idempotency-Key", "a\nb");
    assert_eq!(spec.derive(&d), Err(KeyError::ControlCharacter { at: 1 }));
    let d = json("{}").with_metadata("Idempotency-Key", "x".repeat(10_000));
    assert_eq!(
        spec.derive(&d),
        Err(KeyError::TooLong {
            len: 10_000,
            max: 255
        })
    );
}

#[test]
fn uuid_header_is_validated() {
    let spec = KeySpec::parse("header:Idempotency-Key;uuid").unwrap();
    let ok = json("{}").with_metadata("Idempotency-Key", "8e629a6e-2b0c-4f1e-9a43-5b0b2a3c1d7e");
    assert!(spec.derive(&ok).is_ok());
    let bad = json("{}").with_metadata("Idempotency-Key", "not-a-uuid");
    assert_eq!(spec.derive(&bad), Err(KeyError::NotUuid));
}

#[test]
fn json_pointer_key_takes_scalars() {
    let spec = KeySpec::parse("json:/out_trade_no").unwrap();
    assert_eq!(
        spec.derive(&json(r#"{"out_trade_no":"T1"}"#))
            .unwrap()
            .as_str(),
        "T1"
    );
    assert_eq!(
        spec.derive(&json(r#"{"out_trade_no":42}"#))
            .unwrap()
            .as_str(),
        "42"
    );
    let nested = KeySpec::json_field("/order/id");
    assert_eq!(
        nested
            .derive(&json(r#"{"order":{"id":"o-9"}}"#))
            .unwrap()
            .as_str(),
        "o-9"
    );
}

#[test]
fn json_pointer_errors_are_precise() {
    let spec = KeySpec::json_field("/out_trade_no");
    assert_eq!(
        spec.derive(&json(r#"{"other":1}"#)),
        Err(KeyError::MissingField {
            pointer: "/out_trade_no".into()
        })
    );
    assert_eq!(
        spec.derive(&json(r#"{"out_trade_no":null}"#)),
        Err(KeyError::MissingField {
            pointer: "/out_trade_no".into()
        })
    );
    assert_eq!(
        spec.derive(&json(r#"{"out_trade_no":{"a":1}}"#)),
        Err(KeyError::NotScalar {
            pointer: "/out_trade_no".into()
        })
    );
    assert_eq!(
        spec.derive(&json(r#"{"out_trade_no":""}"#)),
        Err(KeyError::Empty)
    );
    let err = spec.derive(&json("{oops")).unwrap_err();
    assert!(matches!(err, KeyError::NotJson(_)));
    assert_eq!(err.reason(), "decode_error");
    let err = spec
        .derive(&Delivery::new(b"\xff\xfe{}".to_vec()))
        .unwrap_err();
    assert!(matches!(err, KeyError::NotJson(_)));
}

#[test]
fn composite_keys_do_not_collide_on_separators() {
    let spec = KeySpec::parse("json:/user_id+/coupon_id").unwrap();
    let a = spec
        .derive(&json(r#"{"user_id":"a+b","coupon_id":"c"}"#))
        .unwrap();
    let b = spec
        .derive(&json(r#"{"user_id":"a","coupon_id":"b+c"}"#))
        .unwrap();
    let c = spec
        .derive(&json(r#"{"user_id":"a\",\"b","coupon_id":"c"}"#))
        .unwrap();
    let d = spec
        .derive(&json(r#"{"user_id":"a","coupon_id":"b\",\"c"}"#))
        .unwrap();
    let keys = [&a, &b, &c, &d];
    for (i, x) in keys.iter().enumerate() {
        for y in &keys[i + 1..] {
            assert_ne!(x, y);
        }
    }
    assert_eq!(
        spec.derive(&json(r#"{"user_id":7,"coupon_id":"c9"}"#))
            .unwrap()
            .as_str(),
        r#"["7","c9"]"#
    );
}

#[test]
fn fingerprint_key_is_canonical_and_covers_every_part() {
    let spec = KeySpec::parse("fingerprint").unwrap();
    let base = || json(r#"{"a":1,"b":2}"#).with_request("POST", "/orders");
    let k1 = spec.derive(&base()).unwrap();
    let k2 = spec
        .derive(&json("{ \"b\":2.0, \"a\":1 }").with_request("POST", "/orders"))
        .unwrap();
    assert_eq!(k1, k2);
    assert_eq!(k1.as_str().len(), 64);
    let other_path = spec
        .derive(&json(r#"{"a":1,"b":2}"#).with_request("POST", "/refunds"))
        .unwrap();
    let other_user = spec.derive(&base().with_principal("alice")).unwrap();
    let other_method = spec
        .derive(&json(r#"{"a":1,"b":2}"#).with_request("PATCH", "/orders"))
        .unwrap();
    assert_ne!(k1, other_path);
    assert_ne!(k1, other_user);
    assert_ne!(k1, other_method);
    // Length prefixes keep field boundaries unambiguous.
    let shifted = spec
        .derive(&json(r#"{"a":1,"b":2}"#).with_request("POST/", "orders"))
        .unwrap();
    assert_ne!(k1, shifted);
}

#[test]
fn custom_keys_are_validated_too() {
    let spec = KeySpec::custom(|d| {
        d.source()
            .map(str::to_owned)
            .ok_or_else(|| KeyError::Custom("no source".into()))
    });
    assert_eq!(
        spec.derive(&json("{}").with_source("t/0@1"))
            .unwrap()
            .as_str(),
        "t/0@1"
    );
    assert_eq!(
        spec.derive(&json("{}")),
        Err(KeyError::Custom("no source".into()))
    );
}

#[test]
fn long_keys_can_be_compacted() {
    let spec = KeySpec::parse("header:K;max=100;compact").unwrap();
    let long = "k".repeat(10_000);
    let key = spec
        .derive(&json("{}").with_metadata("K", long.clone()))
        .unwrap();
    assert!(key.as_str().starts_with("sha256:"));
    assert_eq!(key.as_str().len(), 71);
    let again = spec.derive(&json("{}").with_metadata("K", long)).unwrap();
    assert_eq!(key, again);
    let short = spec
        .derive(&json("{}").with_metadata("K", "short"))
        .unwrap();
    assert_eq!(short.as_str(), "short");
}

#[test]
fn bad_expressions_fail_at_build_time() {
    for bad in [
        "",
        "body:/x",
        "json:out_trade_no",
        "json:",
        "header:",
        "header:Bad Name",
        "header:K;max=0",
        "header:K;max=256",
        "header:K;max=abc",
        "header:K;frobnicate",
        "json:/a;uuid",
        "header:K;max=20;compact",
    ] {
        assert!(KeySpec::parse(bad).is_err(), "{bad:?} should be rejected");
    }
    assert!(KeySpec::json_field("no-slash").validate().is_err());
    assert!(KeySpec::parse("meta:message_id;max=64").is_ok());
    // `+` not followed by `/` belongs to the property name.
    let plus = KeySpec::parse("json:/a+b").unwrap();
    assert_eq!(plus.derive(&json(r#"{"a+b":"v"}"#)).unwrap().as_str(), "v");
}

#[test]
fn message_key_source() {
    let spec = KeySpec::parse("message-key").unwrap();
    let d = Delivery::new(b"{}".to_vec()).with_message_key(b"order-7".to_vec());
    assert_eq!(spec.derive(&d).unwrap().as_str(), "order-7");
    assert_eq!(
        spec.derive(&Delivery::new(b"{}".to_vec())),
        Err(KeyError::MissingMessageKey)
    );
    assert_eq!(
        spec.derive(&Delivery::new(b"{}".to_vec()).with_message_key(vec![0xff])),
        Err(KeyError::NotUtf8)
    );
}
