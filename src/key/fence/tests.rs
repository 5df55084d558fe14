//! The fence specs' tests: orders derived from deliveries (every kind of
//! component, timestamps in every form, fallbacks, ties, limits), the
//! encoding's bytes, the string form both ways, and entity with order.

use super::time::unix_millis;
use super::*;

fn delivery(json: &str) -> Delivery {
    Delivery::new(json.as_bytes().to_vec())
}

fn order(spec: &OrderSpec, json: &str) -> Order {
    spec.derive(&delivery(json)).unwrap()
}

fn err(spec: &OrderSpec, json: &str) -> KeyError {
    spec.derive(&delivery(json)).unwrap_err()
}

fn ms(millis: i64) -> Order {
    Order::builder().timestamp_ms(millis).build()
}

/// 2024-05-01T02:00:00Z.
const MAY_FIRST: i64 = 1_714_528_800_000;

/// Issue 44, defect 5: a numeric timestamp in seconds (JSON) and the
/// same instant as Avro's `timestamp-millis`, `-micros` and `-nanos`
/// give one order (nanos no longer overflow into `bad_key`), and a
/// later instant in any unit is later.
#[test]
fn numeric_timestamps_carry_their_unit_by_magnitude() {
    let spec = OrderSpec::timestamp("/at");
    let s = MAY_FIRST / 1000;
    for at in [
        s.to_string(),
        MAY_FIRST.to_string(),
        (MAY_FIRST * 1_000).to_string(),
        (MAY_FIRST * 1_000_000).to_string(),
        format!("{s}.0004"),
    ] {
        assert_eq!(
            order(&spec, &format!(r#"{{"at":{at}}}"#)),
            ms(MAY_FIRST),
            "{at}"
        );
    }
    let later_seconds = order(&spec, &format!(r#"{{"at":{}}}"#, s + 1));
    let millis = order(&spec, &format!(r#"{{"at":{}}}"#, MAY_FIRST + 1));
    let nanos = order(
        &spec,
        &format!(r#"{{"at":{}}}"#, (MAY_FIRST + 2) * 1_000_000),
    );
    assert!(millis < later_seconds && nanos < later_seconds && millis < nanos);
    assert_eq!(order(&spec, r#"{"at":1.7145288e12}"#), ms(MAY_FIRST));
}

// ---------------------------------------------------------- encoding

#[test]
fn integers_sort_bytewise_across_the_sign_and_the_encoding_is_fixed() {
    let values = [i64::MIN, -1_000_000, -256, -1, 0, 1, 255, 256, i64::MAX];
    let orders: Vec<Order> = values
        .iter()
        .map(|&v| Order::builder().integer(v).build())
        .collect();
    for pair in orders.windows(2) {
        assert!(pair[0] < pair[1], "{pair:?}");
        assert!(pair[0].as_bytes() < pair[1].as_bytes());
    }
    // Stored forever: the exact bytes.
    assert_eq!(orders[4].as_bytes(), [0x80, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        orders[3].as_bytes(),
        [0x7F, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
    );
    assert_eq!(orders[0].as_bytes(), [0; 8]);
    assert_eq!(orders[8].as_bytes(), [0xFF; 8]);
    assert_eq!(
        Order::builder()
            .rank(2)
            .text("a\0")
            .integer(1)
            .build()
            .as_bytes(),
        [
            0x80, 0, 0, 0, 0, 0, 0, 2, //
            b'a', 0, 0xFF, 0, 0, //
            0x80, 0, 0, 0, 0, 0, 0, 1,
        ]
    );
    // What the store gives back compares the same.
    let back = Order::from_bytes(orders[2].as_bytes().to_vec());
    assert_eq!(back, orders[2]);
    assert_eq!(back.to_string(), "7fffffffffffff00");
    assert_eq!(format!("{back:?}"), "Order(7fffffffffffff00)");

    let spec = OrderSpec::integer("/v");
    assert!(order(&spec, r#"{"v":-5}"#) < order(&spec, r#"{"v":"3"}"#));
    assert!(order(&spec, r#"{"v":"-10"}"#) < order(&spec, r#"{"v":-9}"#));
    assert_eq!(order(&spec, r#"{"v":"42"}"#), order(&spec, r#"{"v":42}"#));
}

#[test]
fn texts_sort_bytewise_with_nuls_and_prefixes_even_before_another_component() {
    let text = |t: &str| Order::builder().text(t).build();
    assert!(text("") < text("\0"));
    assert!(text("a") < text("a\0"));
    assert!(text("a\0") < text("a\0\0"));
    assert!(text("a\0\0") < text("a\u{1}"));
    assert!(text("a\0") < text("ab"));
    assert!(text("ab") < text("b"));
    // (text, integer): the text decides whatever the integer.
    let pair = |t: &str, i: i64| Order::builder().text(t).integer(i).build();
    assert!(pair("a", i64::MAX) < pair("a\0", i64::MIN));
    assert!(pair("a\0", i64::MAX) < pair("ab", i64::MIN));
    assert!(pair("a", 1) < pair("a", 2));
    assert!(pair("a", -1) < pair("ab", -100));

    let spec = OrderSpec::text("/id").then(OrderSpec::integer("/n"));
    let a = order(&spec, r#"{"id":"a","n":9}"#);
    let a_nul = order(&spec, "{\"id\":\"a\\u0000\",\"n\":-9}");
    let ab = order(&spec, r#"{"id":"ab","n":1}"#);
    assert!(a < a_nul && a_nul < ab);
    assert_eq!(spec.describe(&a_nul), r#"id="a\0", n=-9"#);
}

// -------------------------------------------------------- timestamps

#[test]
fn one_instant_in_every_form_is_one_order() {
    let spec = OrderSpec::timestamp("/t");
    for form in [
        r#""2024-05-01T10:00:00+08:00""#,
        r#""2024-05-01T02:00:00Z""#,
        r#""2024-05-01T03:00:00+01:00""#,
        r#""2024-04-30T21:00:00-05:00""#,
        r#""2024-05-01t02:00:00z""#,
        r#""2024-05-01 02:00:00Z""#,
        r#""2024-05-01T02:00:00.000Z""#,
        r#""2024-05-01 02:00:00""#,
        r#""2024-05-01T02:00:00""#,
        "1714528800",
        "1714528800.0",
        r#""1714528800""#,
    ] {
        assert_eq!(
            order(&spec, &format!(r#"{{"t":{form}}}"#)),
            ms(MAY_FIRST),
            "{form}"
        );
    }
    // Naive times at the spec's offset; times with one keep theirs.
    let beijing = OrderSpec::timestamp("/t").with_offset(8 * 3600);
    assert_eq!(
        order(&beijing, r#"{"t":"2024-05-01 10:00:00"}"#),
        ms(MAY_FIRST)
    );
    assert_eq!(
        order(&beijing, r#"{"t":"2024-05-01T02:00:00Z"}"#),
        ms(MAY_FIRST)
    );
    assert_eq!(order(&beijing, r#"{"t":1714528800}"#), ms(MAY_FIRST));
    assert_eq!(
        spec.describe(&order(&spec, r#"{"t":1714528800}"#)),
        "t=2024-05-01T02:00:00Z"
    );
}

#[test]
fn a_later_instant_with_an_earlier_clock_reading_sorts_later() {
    let spec = OrderSpec::timestamp("/t");
    let beijing_ten = order(&spec, r#"{"t":"2024-05-01T10:00:00+08:00"}"#);
    let utc_three = order(&spec, r#"{"t":"2024-05-01T03:00:00Z"}"#);
    assert!(beijing_ten < utc_three);
    // A day boundary crossed by the offset.
    let late_new_york = order(&spec, r#"{"t":"2024-04-30T23:30:00-05:00"}"#);
    let early_utc = order(&spec, r#"{"t":"2024-05-01T03:00:00Z"}"#);
    assert!(early_utc < late_new_york);
    // Before the epoch too.
    assert!(order(&spec, r#"{"t":"1969-12-31T23:59:59Z"}"#) < order(&spec, r#"{"t":0}"#));
    assert_eq!(order(&spec, r#"{"t":"1969-12-31T23:59:59Z"}"#), ms(-1000));
}

#[test]
fn fractions_of_seconds_are_kept_to_the_millisecond_rounded_down() {
    let spec = OrderSpec::timestamp("/t");
    let half = ms(MAY_FIRST + 500);
    assert_eq!(order(&spec, r#"{"t":"2024-05-01T02:00:00.5Z"}"#), half);
    assert_eq!(order(&spec, r#"{"t":1714528800.5}"#), half);
    assert_eq!(order(&spec, r#"{"t":"1714528800.500"}"#), half);
    assert_eq!(order(&spec, r#"{"t":"2024-05-01T02:00:00.5009Z"}"#), half);
    assert_eq!(order(&spec, r#"{"t":"2024-05-01 02:00:00.500"}"#), half);
    assert!(order(&spec, r#"{"t":"2024-05-01T02:00:00.001Z"}"#) > ms(MAY_FIRST));
    assert_eq!(unix_millis("-1.0005"), Some(Ok(-1001)));
    assert_eq!(unix_millis("-1.5"), Some(Ok(-1500)));
    assert_eq!(unix_millis("1.9999"), Some(Ok(1999)));
    assert_eq!(unix_millis("99999999999999999"), Some(Err("out of range")));
    assert_eq!(unix_millis("1."), None);
    assert_eq!(unix_millis(".5"), None);
    assert_eq!(unix_millis("1e9"), None);
    assert_eq!(
        spec.describe(&half),
        "t=2024-05-01T02:00:00.500Z",
        "describe keeps the milliseconds"
    );
}

#[test]
fn bad_timestamps_are_bad_orders_without_their_value() {
    let spec = OrderSpec::timestamp("/t");
    for bad_value in [
        r#""2024-13-01T00:00:00Z""#,
        r#""2024-02-30T00:00:00Z""#,
        r#""2024-05-01x02:00:00Z""#,
        r#""2024-05-01T02:00Z""#,
        r#""2024-05-01T02:00:00+0800""#,
        r#""2024-05-01T02:00:00+08:00Z""#,
        r#""secret-customer-4711""#,
        r#""""#,
        "1e300",
        "true",
        "{}",
        "[1]",
    ] {
        let e = err(&spec, &format!(r#"{{"t":{bad_value}}}"#));
        let KeyError::BadOrder { pointer, .. } = &e else {
            panic!("{bad_value}: {e:?}");
        };
        assert_eq!(pointer, "/t");
        assert!(!e.to_string().contains("secret"), "{e}");
        assert_eq!(e.reason(), "bad_key");
    }
    assert_eq!(
        err(&spec, r#"{"t":null}"#),
        KeyError::MissingField {
            pointer: "/t".into()
        }
    );
    assert_eq!(
        err(&spec, r#"{"other":1}"#),
        KeyError::MissingField {
            pointer: "/t".into()
        }
    );
    assert!(matches!(err(&spec, "not json"), KeyError::NotJson(_)));
}

// ------------------------------------------------------ other kinds

#[test]
fn ranks_are_positions_and_unknown_values_are_refused() {
    let spec = OrderSpec::rank("/s", ["pending", "succeeded", "refunded"]);
    let pending = order(&spec, r#"{"s":"pending"}"#);
    let succeeded = order(&spec, r#"{"s":"succeeded"}"#);
    let refunded = order(&spec, r#"{"s":"refunded"}"#);
    assert!(pending < succeeded && succeeded < refunded);
    assert_eq!(refunded, Order::builder().rank(2).build());
    assert_eq!(spec.describe(&refunded), "s=refunded");
    assert_eq!(spec.describe(&Order::builder().rank(7).build()), "s=#7");
    let e = err(&spec, r#"{"s":"chargeback-of-alice"}"#);
    assert!(matches!(&e, KeyError::BadOrder { pointer, .. } if pointer == "/s"));
    assert!(!e.to_string().contains("alice"), "{e}");
    assert!(matches!(
        err(&spec, r#"{"s":"Pending"}"#),
        KeyError::BadOrder { .. }
    ));
    // Scalars compare as text.
    let numeric = OrderSpec::rank("/s", ["1", "2", "true"]);
    assert!(order(&numeric, r#"{"s":1}"#) < order(&numeric, r#"{"s":"2"}"#));
    assert_eq!(
        order(&numeric, r#"{"s":true}"#),
        Order::builder().rank(2).build()
    );
}

#[test]
fn integers_and_texts_refuse_other_types() {
    let integer = OrderSpec::integer("/v");
    for bad_value in [
        "1.5",
        "18446744073709551615",
        r#""7x""#,
        r#""""#,
        "true",
        "[]",
    ] {
        let e = err(&integer, &format!(r#"{{"v":{bad_value}}}"#));
        assert!(matches!(e, KeyError::BadOrder { .. }), "{bad_value}: {e:?}");
    }
    let text = OrderSpec::text("/id");
    assert!(matches!(
        err(&text, r#"{"id":10}"#),
        KeyError::BadOrder { .. }
    ));
    assert!(matches!(
        err(&text, r#"{"id":{}}"#),
        KeyError::BadOrder { .. }
    ));
    assert_eq!(
        order(&text, r#"{"id":""}"#),
        Order::builder().text("").build()
    );
}

#[test]
fn header_integers_come_from_metadata() {
    let spec = OrderSpec::header_integer("X-Version");
    let d = Delivery::new(b"not json".to_vec()).with_metadata("x-version", " 42 ");
    assert_eq!(
        spec.derive(&d).unwrap(),
        Order::builder().integer(42).build()
    );
    assert_eq!(
        spec.derive(&Delivery::new(b"{}".to_vec())).unwrap_err(),
        KeyError::MissingMetadata {
            name: "X-Version".into()
        }
    );
    let bad_value = Delivery::new(b"{}".to_vec()).with_metadata("X-Version", "v2");
    assert!(matches!(
        spec.derive(&bad_value),
        Err(KeyError::BadOrder { .. })
    ));
    let not_utf8 = Delivery::new(b"{}".to_vec()).with_metadata("X-Version", vec![0xFF]);
    assert!(matches!(
        spec.derive(&not_utf8),
        Err(KeyError::BadOrder { .. })
    ));
    assert_eq!(
        spec.describe(&Order::builder().integer(42).build()),
        "X-Version=42"
    );
}

#[test]
fn then_breaks_ties_only() {
    let spec = OrderSpec::rank("/s", ["a", "b"]).then(OrderSpec::timestamp("/t"));
    let a_late = order(&spec, r#"{"s":"a","t":"2024-05-01T12:00:00Z"}"#);
    let a_early = order(&spec, r#"{"s":"a","t":"2024-05-01T01:00:00Z"}"#);
    let b_early = order(&spec, r#"{"s":"b","t":"2024-05-01T00:00:00Z"}"#);
    assert!(a_early < a_late, "same rank: the time decides");
    assert!(a_late < b_early, "the rank decides first");
    assert_eq!(
        a_late,
        order(&spec, r#"{"s":"a","t":"2024-05-01T12:00:00+00:00"}"#)
    );
    assert_eq!(spec.describe(&b_early), "s=b, t=2024-05-01T00:00:00Z");
    // The second component is read only... but it must be present.
    assert_eq!(
        err(&spec, r#"{"s":"a"}"#),
        KeyError::MissingField {
            pointer: "/t".into()
        }
    );
}

#[test]
fn fallbacks_read_the_first_field_present() {
    let spec = OrderSpec::timestamp("/a").fallback("/b").fallback("/c");
    assert_eq!(order(&spec, r#"{"a":1,"b":2}"#), ms(1000));
    assert_eq!(order(&spec, r#"{"a":null,"b":2}"#), ms(2000));
    assert_eq!(order(&spec, r#"{"c":3}"#), ms(3000));
    assert_eq!(
        err(&spec, r#"{"d":4}"#),
        KeyError::MissingField {
            pointer: "/a|/b|/c".into()
        }
    );
    // A present but unusable field is an error, not a reason to fall back.
    assert!(matches!(
        err(&spec, r#"{"a":"soon","b":2}"#),
        KeyError::BadOrder { pointer, .. } if pointer == "/a"
    ));
}

#[test]
fn custom_orders_and_length_limits() {
    let spec = OrderSpec::custom(|d: &Delivery| {
        Ok(Order::builder().integer(d.payload().len() as i64).build())
    });
    spec.validate().unwrap();
    assert_eq!(order(&spec, "{}"), Order::builder().integer(2).build());
    assert_eq!(spec.describe(&order(&spec, "{}")), "8000000000000002");
    assert_eq!(spec.to_string(), "custom");
    let long = OrderSpec::custom(|_: &Delivery| Ok(Order::from_bytes(vec![1; 256])));
    assert!(matches!(
        err(&long, "{}"),
        KeyError::BadOrder { pointer, .. } if pointer == "custom"
    ));
    let refusing = OrderSpec::custom(|_: &Delivery| Err(KeyError::Custom("no".into())));
    assert_eq!(err(&refusing, "{}"), KeyError::Custom("no".into()));

    // 255 bytes pass, 256 do not: a text of 253 bytes plus its terminator.
    let text = OrderSpec::text("/id");
    let fits = format!(r#"{{"id":"{}"}}"#, "x".repeat(253));
    assert_eq!(order(&text, &fits).as_bytes().len(), Order::MAX_LEN);
    let over = format!(r#"{{"id":"{}"}}"#, "x".repeat(254));
    let e = err(&text, &over);
    assert!(
        matches!(&e, KeyError::BadOrder { pointer, .. } if pointer == "id"),
        "{e:?}"
    );
    assert!(e.to_string().contains("256 bytes"), "{e}");
}

// ---------------------------------------------------- string form

#[test]
fn string_forms_round_trip() {
    for expr in [
        "timestamp:/created",
        "integer:/version",
        "header:X-Version",
        "text:/id",
        "rank:/status=pending<succeeded<refunded;then=timestamp:/updated",
        "rank:/trade_status=WAIT_BUYER_PAY<TRADE_SUCCESS;then=timestamp:/gmt_refund|/gmt_payment;offset=+08:00",
        "timestamp:/t;offset=-05:30",
        "timestamp:/t;offset=+00:00",
        "text:/a/b~1c|/d;then=integer:/n;then=header:X-Seq",
    ] {
        let spec = OrderSpec::parse(expr).unwrap();
        assert_eq!(spec.to_string(), expr);
    }
    // Spaces around items and ranked values, `Z`, and builders.
    let spec = OrderSpec::parse(" rank:/s = a < b ; then=timestamp:/t ; offset=Z ").unwrap();
    assert_eq!(
        spec.to_string(),
        "rank:/s=a<b;then=timestamp:/t;offset=+00:00"
    );
    let built = OrderSpec::rank("/s", ["a", "b"])
        .then(OrderSpec::timestamp("/t").fallback("/u"))
        .with_offset(-(3 * 3600 + 1800 + 15));
    assert_eq!(
        built.to_string(),
        "rank:/s=a<b;then=timestamp:/t|/u;offset=-03:30:15"
    );
    let parsed = OrderSpec::parse(&built.to_string()).unwrap();
    let json = r#"{"s":"b","u":"2024-05-01 00:00:00"}"#;
    assert_eq!(order(&parsed, json), order(&built, json));
}

#[test]
fn malformed_string_forms_and_specs_are_refused() {
    let invalid_order = |expr: &str| {
        assert!(
            matches!(OrderSpec::parse(expr), Err(KeySpecError::InvalidOrder(_))),
            "{expr}: {:?}",
            OrderSpec::parse(expr)
        );
    };
    for expr in [
        "",
        "created",
        "json:/created",
        "timestamp",
        "rank:/s",
        "rank:/s=",
        "rank:/s=a<<b",
        "rank:/s=a<b<a",
        "timestamp:/t;offset=+8",
        "timestamp:/t;offset=+08:60",
        "timestamp:/t;offset=08:00",
        "timestamp:/t;offset=+08:00;offset=+08:00",
        "timestamp:/t;then=",
        "timestamp:/t;bogus",
        "timestamp:/t;then=custom",
    ] {
        invalid_order(expr);
    }
    assert_eq!(
        OrderSpec::parse("timestamp:created").unwrap_err(),
        KeySpecError::InvalidPointer("created".into())
    );
    // Split on `|/` only: `/a|b` is one pointer (a property named `a|b`).
    let one = OrderSpec::parse("timestamp:/a|b").unwrap();
    assert_eq!(order(&one, r#"{"a|b":1,"b":2}"#), ms(1000));
    assert_eq!(
        OrderSpec::timestamp("/a")
            .fallback("b")
            .validate()
            .unwrap_err(),
        KeySpecError::InvalidPointer("b".into()),
        "a fallback pointer must start with `/`"
    );
    assert_eq!(
        OrderSpec::parse("integer:").unwrap_err(),
        KeySpecError::InvalidPointer(String::new())
    );
    assert_eq!(
        OrderSpec::parse("header:X Version").unwrap_err(),
        KeySpecError::InvalidName("X Version".into())
    );
    // Builders: the same checks in `validate`.
    let custom = || OrderSpec::custom(|_: &Delivery| Ok(Order::builder().build()));
    for spec in [
        custom().then(OrderSpec::integer("/v")),
        OrderSpec::integer("/v").then(custom()),
        custom().fallback("/v"),
        OrderSpec::header_integer("X-V").fallback("/v"),
        OrderSpec::rank("/s", Vec::<String>::new()),
        OrderSpec::timestamp("/t").with_offset(24 * 3600),
        OrderSpec::timestamp("/t")
            .with_offset(3600)
            .then(OrderSpec::timestamp("/u").with_offset(7200)),
    ] {
        assert!(
            matches!(spec.validate(), Err(KeySpecError::InvalidOrder(_))),
            "{spec:?}"
        );
    }
    // An invalid spec never derives.
    let combined = custom().then(OrderSpec::integer("/v"));
    assert!(matches!(
        err(&combined, r#"{"v":1}"#),
        KeyError::BadOrder { .. }
    ));
    assert_eq!(combined.to_string(), "invalid");
    // Agreeing offsets, or one unset, combine.
    OrderSpec::timestamp("/t")
        .with_offset(3600)
        .then(OrderSpec::timestamp("/u").with_offset(3600))
        .then(OrderSpec::timestamp("/v"))
        .validate()
        .unwrap();
}

#[test]
fn bad_order_errors_say_bad_key() {
    let e = KeyError::BadOrder {
        pointer: "/t".into(),
        reason: "not a timestamp".into(),
    };
    assert_eq!(e.reason(), "bad_key");
    assert_eq!(
        e.to_string(),
        r#"order field "/t" is unusable: not a timestamp"#
    );
}

// ------------------------------------------------------- FenceSpec

#[test]
fn fence_specs_derive_entity_then_order() {
    let fence = FenceSpec::new(KeySpec::json_field("/id"), OrderSpec::integer("/v"));
    assert!(!fence.passes_stale());
    assert!(fence.clone().pass_stale(true).passes_stale());
    fence.validate().unwrap();
    assert_eq!(
        fence.derive(&delivery(r#"{"id":"o-1","v":3}"#)).unwrap(),
        FenceValue {
            entity: IdemKey::new("o-1").unwrap(),
            order: Order::builder().integer(3).build(),
        }
    );
    // The entity's error comes first, with all of KeySpec's limits.
    assert_eq!(
        fence.derive(&delivery(r#"{"v":"x"}"#)).unwrap_err(),
        KeyError::MissingField {
            pointer: "/id".into()
        }
    );
    let long = format!(r#"{{"id":"{}","v":1}}"#, "x".repeat(300));
    assert!(matches!(
        fence.derive(&delivery(&long)),
        Err(KeyError::TooLong { .. })
    ));
    let bad_entity = FenceSpec::new(KeySpec::json_field("id"), OrderSpec::integer("/v"));
    assert_eq!(
        bad_entity.validate().unwrap_err(),
        KeySpecError::InvalidPointer("id".into())
    );
    let bad_order = FenceSpec::new(KeySpec::json_field("/id"), OrderSpec::integer("v"));
    assert_eq!(
        bad_order.validate().unwrap_err(),
        KeySpecError::InvalidPointer("v".into())
    );
}
