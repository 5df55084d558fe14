//! The payment providers' fence presets, [`FenceSpec::stripe`],
//! [`FenceSpec::wechat_pay`], [`FenceSpec::alipay`] and
//! [`FenceSpec::adyen`] (feature `providers`): which entity each
//! provider's callback is about and its order, read from the payload the
//! provider's route hands the handler. The guide is `docs/fences.md`.

use serde_json::Value;

use crate::delivery::Delivery;
use crate::fingerprint::canonical_bytes;
use crate::key::{FenceSpec, KeyError, KeySpec, OrderSpec};

/// Beijing time, the zone of Alipay's `yyyy-MM-dd HH:mm:ss` times.
const BEIJING: i32 = 8 * 3600;

/// Where Adyen's envelope keeps its (one) notification item.
const ADYEN_ITEM: &str = "/notificationItems/0/NotificationRequestItem";

/// The payment providers' presets (feature `providers`).
#[cfg_attr(docsrs, doc(cfg(feature = "providers")))]
impl FenceSpec {
    /// Stripe events (the event as received): the entity is the event's
    /// object (`/data/object/id`: a PaymentIntent, a Charge, a Refund),
    /// the order the event's `created` (Unix seconds). Each event carries
    /// its object as it was when the event happened, so the latest one
    /// stands for the earlier ones. Two events of the same second are
    /// equal, so neither is stale: event ids are random, not
    /// chronological, and a tiebreak on them would drop the newer of the
    /// two half of the time. Events whose object has no `id` (`balance.*`)
    /// have no entity ([`KeyError::MissingField`]).
    pub fn stripe() -> Self {
        Self::new(
            KeySpec::json_field("/data/object/id"),
            OrderSpec::timestamp("/created"),
        )
    }

    /// WeChat Pay API v3 notifications (the decrypted `resource`: a
    /// transaction or a refund). The entity is a payment or one refund:
    /// the canonical JSON array of `out_trade_no` and `out_refund_no`
    /// (`""` for a payment), e.g. `["1217752501201407033233368018",""]`.
    /// The order is the state's rank: `refund_status` (a refund), else
    /// `trade_state` (a payment), `ABNORMAL < SUCCESS < CLOSED`, so a late
    /// `ABNORMAL` of a refund that has since succeeded is stale. Not the
    /// trade alone, and not `success_time`: a refund notification carries
    /// that refund only (not the refunds before it), so ordering a trade's
    /// refunds by time would drop an earlier refund delivered late; and
    /// `success_time` is absent from `ABNORMAL` and `CLOSED` refunds, while
    /// the envelope's `create_time` is not in the payload. WeChat Pay
    /// notifies payments on `SUCCESS` only; another state is a
    /// [`KeyError::BadOrder`].
    pub fn wechat_pay() -> Self {
        Self::new(
            KeySpec::custom(wechat_entity),
            OrderSpec::rank("/refund_status", ["ABNORMAL", "SUCCESS", "CLOSED"])
                .fallback("/trade_state"),
        )
    }

    /// Alipay notifications (the signed fields as a JSON object): the
    /// entity is `out_trade_no`, the order the rank of `trade_status`
    /// (`WAIT_BUYER_PAY < TRADE_SUCCESS < TRADE_FINISHED < TRADE_CLOSED`),
    /// then the time of the event: `gmt_refund`, else `gmt_payment`, else
    /// `gmt_create`, read in Beijing time (+08:00). `TRADE_CLOSED` is
    /// final whether it closes an unpaid trade or a fully refunded one,
    /// and `TRADE_FINISHED` is final too; no trade reaches both. Partial
    /// refunds stay at `TRADE_SUCCESS` and are ordered by `gmt_refund`:
    /// each notification carries the trade as it stands (`refund_fee` is
    /// the total refunded), so the latest one stands for the earlier
    /// ones. Never `notify_time`: it is set anew on every retry of the
    /// same notification, so an old event retried late would look newer
    /// than the events after it.
    pub fn alipay() -> Self {
        Self::new(
            KeySpec::json_field("/out_trade_no"),
            OrderSpec::rank(
                "/trade_status",
                [
                    "WAIT_BUYER_PAY",
                    "TRADE_SUCCESS",
                    "TRADE_FINISHED",
                    "TRADE_CLOSED",
                ],
            )
            .then(
                OrderSpec::timestamp("/gmt_refund")
                    .fallback("/gmt_payment")
                    .fallback("/gmt_create"),
            )
            .with_offset(BEIJING),
        )
    }

    /// Adyen notification items (in Adyen's envelope,
    /// `/notificationItems/0/NotificationRequestItem`, or a bare item):
    /// the entity is the item's `pspReference` (a payment, or one
    /// modification of it: each partial refund and each capture has its
    /// own, so that one is never stale behind another), the order its
    /// `eventDate` (RFC 3339): an older event of a reference delivered
    /// after a newer one of the same reference is stale.
    ///
    /// **`eventDate` is not signed** by Adyen's HMAC, and the `providers`
    /// route's payload holds signed fields only: on that route every
    /// delivery fails with [`KeyError::MissingField`]. This preset is for
    /// items whose `eventDate` can be trusted (an item forwarded whole by
    /// a service that received it directly from Adyen): a replayed item
    /// with a forged `eventDate` in the future would make every later
    /// event of its reference stale.
    pub fn adyen() -> Self {
        Self::new(
            KeySpec::custom(adyen_entity),
            OrderSpec::timestamp(format!("{ADYEN_ITEM}/eventDate")).fallback("/eventDate"),
        )
    }
}

/// The scalar at `pointer` as text; `None` when absent or `null`.
fn scalar(json: &Value, pointer: &str) -> Result<Option<String>, KeyError> {
    match json.pointer(pointer) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(Value::Bool(b)) => Ok(Some(b.to_string())),
        Some(Value::Array(_) | Value::Object(_)) => Err(KeyError::NotScalar {
            pointer: pointer.to_owned(),
        }),
    }
}

/// WeChat Pay: `[out_trade_no, out_refund_no or ""]` as canonical JSON.
fn wechat_entity(delivery: &Delivery) -> Result<String, KeyError> {
    let json = delivery
        .json()
        .map_err(|e| KeyError::NotJson(e.to_owned()))?;
    let trade = scalar(json, "/out_trade_no")?.ok_or_else(|| KeyError::MissingField {
        pointer: "/out_trade_no".into(),
    })?;
    let refund = scalar(json, "/out_refund_no")?.unwrap_or_default();
    String::from_utf8(canonical_bytes(&[trade, refund])).map_err(|_| KeyError::NotUtf8)
}

/// Adyen: the item's `pspReference`.
fn adyen_entity(delivery: &Delivery) -> Result<String, KeyError> {
    let json = delivery
        .json()
        .map_err(|e| KeyError::NotJson(e.to_owned()))?;
    let prefix = if json.get("notificationItems").is_some() {
        ADYEN_ITEM
    } else {
        ""
    };
    // Each item is one event of its own `pspReference` (a payment, or one
    // modification of it): a partial refund never stales another one.
    match scalar(json, &format!("{prefix}/pspReference"))? {
        Some(reference) if !reference.is_empty() => Ok(reference),
        _ => Err(KeyError::MissingField {
            pointer: format!("{prefix}/pspReference"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Order;

    fn delivery(json: &str) -> Delivery {
        Delivery::new(json.as_bytes().to_vec())
    }

    fn ms(millis: i64) -> Order {
        Order::builder().timestamp_ms(millis).build()
    }

    /// 2024-05-01T02:00:00Z.
    const MAY_FIRST: i64 = 1_714_528_800_000;

    /// The presets' orders are string forms, and the presets are valid.
    #[test]
    fn presets_are_valid_and_their_orders_are_string_forms() {
        for fence in [
            FenceSpec::stripe(),
            FenceSpec::wechat_pay(),
            FenceSpec::alipay(),
            FenceSpec::adyen(),
        ] {
            fence.validate().unwrap();
            assert!(!fence.passes_stale());
            let expr = fence.order().to_string();
            assert_eq!(OrderSpec::parse(&expr).unwrap().to_string(), expr);
        }
        assert_eq!(
            FenceSpec::alipay().order().to_string(),
            "rank:/trade_status=WAIT_BUYER_PAY<TRADE_SUCCESS<TRADE_FINISHED<TRADE_CLOSED;then=timestamp:/gmt_refund|/gmt_payment|/gmt_create;offset=+08:00"
        );
    }

    // Stripe: the event as received (`src/http/providers/stripe.rs`).
    fn stripe_event(id: &str, kind: &str, created: i64, status: &str) -> String {
        serde_json::json!({
            "id": id,
            "object": "event",
            "api_version": "2024-04-10",
            "created": created,
            "data": {"object": {
                "id": "pi_3P9f2aLkdIwHu7ix0eT1uVb8",
                "object": "payment_intent",
                "amount": 2000,
                "currency": "usd",
                "status": status,
            }},
            "livemode": false,
            "pending_webhooks": 1,
            "request": {"id": null, "idempotency_key": null},
            "type": kind,
        })
        .to_string()
    }

    #[test]
    fn stripe_orders_an_object_by_its_events_created() {
        let fence = FenceSpec::stripe();
        let created = fence
            .derive(&delivery(&stripe_event(
                "evt_3P9f2aLkdIwHu7ix0Kx1q2Bq",
                "payment_intent.created",
                1_714_528_800,
                "requires_payment_method",
            )))
            .unwrap();
        let succeeded = fence
            .derive(&delivery(&stripe_event(
                "evt_3P9f2aLkdIwHu7ix0Z8aJtLm",
                "payment_intent.succeeded",
                1_714_528_805,
                "succeeded",
            )))
            .unwrap();
        assert_eq!(created.entity.as_str(), "pi_3P9f2aLkdIwHu7ix0eT1uVb8");
        assert_eq!(created.entity, succeeded.entity);
        assert_eq!(created.order, ms(MAY_FIRST));
        assert!(created.order < succeeded.order);
        assert_eq!(
            fence.order().describe(&created.order),
            "created=2024-05-01T02:00:00Z"
        );
        // Two events of one second are equal: neither is stale.
        let same_second = fence
            .derive(&delivery(&stripe_event(
                "evt_0000000000000000000000aa",
                "payment_intent.processing",
                1_714_528_805,
                "processing",
            )))
            .unwrap();
        assert_eq!(same_second.order, succeeded.order);
        // An event whose object has no id has no entity.
        let balance = r#"{"id":"evt_1","object":"event","created":1714528800,"data":{"object":{"object":"balance","available":[]}},"type":"balance.available"}"#;
        assert_eq!(
            fence.derive(&delivery(balance)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/data/object/id".into()
            }
        );
    }

    // WeChat Pay: the decrypted resource (`src/http/providers/wechat.rs`).
    const WECHAT_PAYMENT: &str = r#"{"mchid":"1900000100","appid":"wxd678efh567hg6787","out_trade_no":"1217752501201407033233368018","transaction_id":"1217752501201407033233368018","trade_type":"JSAPI","trade_state":"SUCCESS","trade_state_desc":"支付成功","bank_type":"CMC","success_time":"2018-06-08T10:34:56+08:00","amount":{"total":100,"payer_total":100,"currency":"CNY","payer_currency":"CNY"},"payer":{"openid":"oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"}}"#;

    fn wechat_refund(out_refund_no: &str, status: &str) -> String {
        let mut refund = serde_json::json!({
            "mchid": "1900000100",
            "transaction_id": "1217752501201407033233368018",
            "out_trade_no": "1217752501201407033233368018",
            "refund_id": "50200207182018070300011301001",
            "out_refund_no": out_refund_no,
            "refund_status": status,
            "user_received_account": "招商银行信用卡0403",
            "amount": {"total": 100, "refund": 30, "payer_total": 100, "payer_refund": 30},
        });
        if status == "SUCCESS" {
            refund["success_time"] = "2018-06-09T10:34:56+08:00".into();
        }
        refund.to_string()
    }

    #[test]
    fn wechat_pay_fences_a_payment_and_each_refund_by_state() {
        let fence = FenceSpec::wechat_pay();
        let payment = fence.derive(&delivery(WECHAT_PAYMENT)).unwrap();
        assert_eq!(
            payment.entity.as_str(),
            r#"["1217752501201407033233368018",""]"#
        );
        assert_eq!(
            fence.order().describe(&payment.order),
            "refund_status|trade_state=SUCCESS"
        );

        let abnormal = fence
            .derive(&delivery(&wechat_refund("R1", "ABNORMAL")))
            .unwrap();
        let succeeded = fence
            .derive(&delivery(&wechat_refund("R1", "SUCCESS")))
            .unwrap();
        assert_eq!(
            abnormal.entity.as_str(),
            r#"["1217752501201407033233368018","R1"]"#
        );
        assert_eq!(abnormal.entity, succeeded.entity);
        assert!(abnormal.order < succeeded.order, "a late ABNORMAL is stale");
        // ABNORMAL and CLOSED refunds carry no success_time: still ordered.
        let closed = fence
            .derive(&delivery(&wechat_refund("R1", "CLOSED")))
            .unwrap();
        assert!(abnormal.order < closed.order);
        // Another refund of the same trade is another entity: a late
        // refund is never stale because of another one.
        let other = fence
            .derive(&delivery(&wechat_refund("R2", "ABNORMAL")))
            .unwrap();
        assert_ne!(other.entity, succeeded.entity);
        assert_ne!(payment.entity, succeeded.entity);

        let not_paid =
            WECHAT_PAYMENT.replace(r#""trade_state":"SUCCESS""#, r#""trade_state":"NOTPAY""#);
        assert!(matches!(
            fence.derive(&delivery(&not_paid)),
            Err(KeyError::BadOrder { pointer, .. }) if pointer == "/trade_state"
        ));
        assert_eq!(
            fence
                .derive(&delivery(r#"{"trade_state":"SUCCESS"}"#))
                .unwrap_err(),
            KeyError::MissingField {
                pointer: "/out_trade_no".into()
            }
        );
        assert_eq!(
            fence
                .derive(&delivery(r#"{"out_trade_no":"T1"}"#))
                .unwrap_err(),
            KeyError::MissingField {
                pointer: "/refund_status|/trade_state".into()
            }
        );
    }

    // Alipay: the signed form fields as a JSON object of strings
    // (`src/http/providers/alipay.rs`; fields of its tests).
    fn alipay(status: &str, extra: &[(&str, &str)]) -> String {
        let mut fields = serde_json::json!({
            "notify_time": "2026-12-01 20:00:05",
            "notify_type": "trade_status_sync",
            "notify_id": "ac05099524730693a8b330c5ecf72da9786",
            "app_id": "2014072300007148",
            "charset": "utf-8",
            "version": "1.0",
            "trade_no": "2013112011001004330000121536",
            "out_trade_no": "6823789339978248",
            "trade_status": status,
            "total_amount": "88.88",
            "subject": "中文 商品",
            "gmt_create": "2026-12-01 19:59:00",
        });
        for (k, v) in extra {
            fields[*k] = (*v).into();
        }
        fields.to_string()
    }

    #[test]
    fn alipay_ranks_trade_states_then_event_times_in_beijing_time() {
        let fence = FenceSpec::alipay();
        let derive = |json: String| fence.derive(&delivery(&json)).unwrap();
        let paid_at = [("gmt_payment", "2026-12-01 20:00:00")];
        let waiting = derive(alipay("WAIT_BUYER_PAY", &[]));
        let paid = derive(alipay("TRADE_SUCCESS", &paid_at));
        let refund_1 = derive(alipay(
            "TRADE_SUCCESS",
            &[
                ("gmt_payment", "2026-12-01 20:00:00"),
                ("gmt_refund", "2026-12-02 09:30:00.320"),
                ("out_biz_no", "HZRF001"),
                ("refund_fee", "10.00"),
            ],
        ));
        let refund_2 = derive(alipay(
            "TRADE_SUCCESS",
            &[
                ("gmt_payment", "2026-12-01 20:00:00"),
                ("gmt_refund", "2026-12-03 11:00:00.000"),
                ("out_biz_no", "HZRF002"),
                ("refund_fee", "20.00"),
            ],
        ));
        let closed = derive(alipay(
            "TRADE_CLOSED",
            &[
                ("gmt_payment", "2026-12-01 20:00:00"),
                ("gmt_refund", "2026-12-02 08:00:00"),
                ("gmt_close", "2026-12-02 08:00:00"),
                ("refund_fee", "88.88"),
            ],
        ));
        assert_eq!(paid.entity.as_str(), "6823789339978248");
        for later in [&paid, &refund_1, &refund_2, &closed] {
            assert_eq!(later.entity, waiting.entity);
        }
        assert!(waiting.order < paid.order);
        assert!(
            paid.order < refund_1.order,
            "partial refunds stay at TRADE_SUCCESS"
        );
        assert!(refund_1.order < refund_2.order);
        assert!(
            refund_2.order < closed.order,
            "TRADE_CLOSED is final, whatever its time"
        );
        // Naive times are Beijing time: 20:00 +08:00 is 12:00 UTC.
        assert_eq!(
            paid.order,
            Order::builder()
                .rank(1)
                .timestamp_ms(1_796_126_400_000)
                .build()
        );
        assert_eq!(
            fence.order().describe(&refund_1.order),
            "trade_status=TRADE_SUCCESS, gmt_refund|gmt_payment|gmt_create=2026-12-02T01:30:00.320Z"
        );
        // A retry of the same notification (a new notify_time) is the same order.
        let retried = derive(alipay("TRADE_SUCCESS", &paid_at).replace("20:00:05", "20:04:05"));
        assert_eq!(retried.order, paid.order);
        // An unpaid trade closed on timeout is final too.
        let timed_out = derive(alipay(
            "TRADE_CLOSED",
            &[("gmt_close", "2026-12-01 20:15:00")],
        ));
        assert!(waiting.order < timed_out.order);
        let finished = derive(alipay("TRADE_FINISHED", &paid_at));
        assert!(refund_2.order < finished.order);

        assert!(matches!(
            fence.derive(&delivery(&alipay("TRADE_PENDING", &paid_at))),
            Err(KeyError::BadOrder { pointer, .. }) if pointer == "/trade_status"
        ));
        let no_times = alipay("TRADE_SUCCESS", &[]).replace("gmt_create", "gmt_other");
        assert_eq!(
            fence.derive(&delivery(&no_times)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/gmt_refund|/gmt_payment|/gmt_create".into()
            }
        );
    }

    // Adyen: the route's payload (`signed_only` in
    // `src/http/providers/adyen.rs`) and whole items.
    const ADYEN_ROUTE_PAYLOAD: &str = r#"{"notificationItems":[{"NotificationRequestItem":{"pspReference":"7914073381342284","merchantAccountCode":"TestMerchant","merchantReference":"TestPayment-1407325143704","eventCode":"AUTHORISATION","success":"true","amount":{"value":1130,"currency":"EUR"}}}]}"#;

    fn adyen_item(psp: &str, original: Option<&str>, code: &str, date: &str) -> serde_json::Value {
        let mut item = serde_json::json!({
            "pspReference": psp,
            "merchantAccountCode": "TestMerchant",
            "merchantReference": "TestPayment-1407325143704",
            "amount": {"value": 1130, "currency": "EUR"},
            "eventCode": code,
            "eventDate": date,
            "success": "true",
            "additionalData": {"hmacSignature": "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="},
        });
        if let Some(original) = original {
            item["originalReference"] = original.into();
        }
        item
    }

    fn adyen_envelope(item: serde_json::Value) -> String {
        serde_json::json!({"live": "false", "notificationItems": [{"NotificationRequestItem": item}]})
            .to_string()
    }

    #[test]
    fn adyen_fences_the_payment_by_event_date_where_it_is_delivered() {
        let fence = FenceSpec::adyen();
        let authorised = fence
            .derive(&delivery(&adyen_envelope(adyen_item(
                "7914073381342284",
                None,
                "AUTHORISATION",
                "2021-01-01T01:00:00+01:00",
            ))))
            .unwrap();
        let refunded = fence
            .derive(&delivery(&adyen_envelope(adyen_item(
                "8825408195409505",
                Some("7914073381342284"),
                "REFUND",
                "2021-01-01T00:30:00Z",
            ))))
            .unwrap();
        assert_eq!(authorised.entity.as_str(), "7914073381342284");
        assert_eq!(
            refunded.entity.as_str(),
            "8825408195409505",
            "a refund is an event of its own: never stale behind another refund or the capture"
        );
        assert!(authorised.order < refunded.order, "00:00Z before 00:30Z");
        // A bare item reads the same.
        let bare = fence
            .derive(&delivery(
                &adyen_item(
                    "8825408195409505",
                    Some("7914073381342284"),
                    "REFUND",
                    "2021-01-01T00:30:00Z",
                )
                .to_string(),
            ))
            .unwrap();
        assert_eq!(bare, refunded);
        // An empty originalReference is no reference.
        let empty_original = fence
            .derive(&delivery(&adyen_envelope(adyen_item(
                "7914073381342284",
                Some(""),
                "AUTHORISATION",
                "2021-01-01T01:00:00+01:00",
            ))))
            .unwrap();
        assert_eq!(empty_original, authorised);

        // The providers route keeps signed fields only: no eventDate.
        assert_eq!(
            fence.derive(&delivery(ADYEN_ROUTE_PAYLOAD)).unwrap_err(),
            KeyError::MissingField {
                pointer: "/notificationItems/0/NotificationRequestItem/eventDate|/eventDate".into()
            }
        );
        assert_eq!(
            fence
                .entity()
                .derive(&delivery(ADYEN_ROUTE_PAYLOAD))
                .unwrap()
                .as_str(),
            "7914073381342284"
        );
        assert_eq!(
            fence
                .derive(&delivery(r#"{"notificationItems":[]}"#))
                .unwrap_err(),
            KeyError::MissingField {
                pointer: "/notificationItems/0/NotificationRequestItem/pspReference".into()
            }
        );
    }
}
