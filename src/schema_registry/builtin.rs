//! The `.proto` files Confluent's Protobuf serializers treat as built in,
//! never registered as references: `google/type/*.proto` (the googleapis
//! common types, Apache License 2.0, as published in the
//! `googleapis-common-protos` package) and `confluent/meta.proto`,
//! `confluent/type/decimal.proto`. The `google/protobuf/*.proto` well-known
//! types come with protox.

/// Import name and text of each built-in file.
pub(crate) const FILES: &[(&str, &str)] = &[
    (
        "confluent/meta.proto",
        include_str!("builtin/confluent/meta.proto"),
    ),
    (
        "confluent/type/decimal.proto",
        include_str!("builtin/confluent/type/decimal.proto"),
    ),
    (
        "google/type/calendar_period.proto",
        include_str!("builtin/google/type/calendar_period.proto"),
    ),
    (
        "google/type/color.proto",
        include_str!("builtin/google/type/color.proto"),
    ),
    (
        "google/type/date.proto",
        include_str!("builtin/google/type/date.proto"),
    ),
    (
        "google/type/datetime.proto",
        include_str!("builtin/google/type/datetime.proto"),
    ),
    (
        "google/type/dayofweek.proto",
        include_str!("builtin/google/type/dayofweek.proto"),
    ),
    (
        "google/type/decimal.proto",
        include_str!("builtin/google/type/decimal.proto"),
    ),
    (
        "google/type/expr.proto",
        include_str!("builtin/google/type/expr.proto"),
    ),
    (
        "google/type/fraction.proto",
        include_str!("builtin/google/type/fraction.proto"),
    ),
    (
        "google/type/interval.proto",
        include_str!("builtin/google/type/interval.proto"),
    ),
    (
        "google/type/latlng.proto",
        include_str!("builtin/google/type/latlng.proto"),
    ),
    (
        "google/type/localized_text.proto",
        include_str!("builtin/google/type/localized_text.proto"),
    ),
    (
        "google/type/money.proto",
        include_str!("builtin/google/type/money.proto"),
    ),
    (
        "google/type/month.proto",
        include_str!("builtin/google/type/month.proto"),
    ),
    (
        "google/type/phone_number.proto",
        include_str!("builtin/google/type/phone_number.proto"),
    ),
    (
        "google/type/postal_address.proto",
        include_str!("builtin/google/type/postal_address.proto"),
    ),
    (
        "google/type/quaternion.proto",
        include_str!("builtin/google/type/quaternion.proto"),
    ),
    (
        "google/type/timeofday.proto",
        include_str!("builtin/google/type/timeofday.proto"),
    ),
];
