//! Schema Registry payloads: what decoding an Avro or Protobuf record
//! through [`SchemaRegistry`] costs, against parsing the same record as
//! JSON (the baseline), alone and inside a claim.
//!
//! The registry is a loopback axum server holding one Avro and one
//! Protobuf schema of the same payment (nine fields: strings, a long, an
//! enum, a timestamp, a nested buyer with tags, an optional memo); the
//! payloads are encoded here by hand in the Confluent wire format. Each
//! schema is fetched once, then read from the decoder's cache.

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::routing::get;
use onceonly::engine::PayloadDecoder;
use onceonly::schema_registry::SchemaRegistry;
use onceonly::{Delivery, Engine, PgStore, SqlStore};

use super::common::{Bench, Mode, Res, pool};
use super::growth::Noop;
use super::stats::Table;

const AVRO: &str = r#"{"type":"record","name":"Payment","namespace":"bench","fields":[
  {"name":"out_trade_no","type":"string"},
  {"name":"amount_fen","type":"long"},
  {"name":"currency","type":"string"},
  {"name":"status","type":{"type":"enum","name":"Status","symbols":["PAID","REFUNDED"]}},
  {"name":"paid_at","type":{"type":"long","logicalType":"timestamp-millis"}},
  {"name":"buyer","type":{"type":"record","name":"Buyer","fields":[
    {"name":"id","type":"string"},{"name":"tags","type":{"type":"array","items":"string"}}]}},
  {"name":"memo","type":["null","string"],"default":null}]}"#;

const PROTO: &str = r#"syntax = "proto3";
package bench;
message Payment {
  enum Status { PAID = 0; REFUNDED = 1; }
  message Buyer { string id = 1; repeated string tags = 2; }
  string out_trade_no = 1;
  int64 amount_fen = 2;
  string currency = 3;
  Status status = 4;
  int64 paid_at = 5;
  Buyer buyer = 6;
  string memo = 7;
}"#;

/// The i-th payment in three encodings: JSON, Avro, Protobuf.
fn payment(i: usize, prefix: &str) -> [Vec<u8>; 3] {
    let no = format!("{prefix}-{i:08}");
    let amount = 100 + i as i64;
    let json = serde_json::json!({
        "out_trade_no": no, "amount_fen": amount, "currency": "CNY", "status": "REFUNDED",
        "paid_at": 1_796_466_600_000_i64, "buyer": {"id": "u-7", "tags": ["vip", "cn"]},
        "memo": null,
    });
    let mut avro = vec![0, 0, 0, 0, 1];
    avro_str(&mut avro, &no);
    zigzag(&mut avro, amount);
    avro_str(&mut avro, "CNY");
    zigzag(&mut avro, 1); // REFUNDED
    zigzag(&mut avro, 1_796_466_600_000);
    avro_str(&mut avro, "u-7");
    zigzag(&mut avro, 2); // a block of two tags
    avro_str(&mut avro, "vip");
    avro_str(&mut avro, "cn");
    zigzag(&mut avro, 0); // end of the array
    zigzag(&mut avro, 0); // memo: the null branch
    let mut proto = vec![0, 0, 0, 0, 2, 0]; // message index [0]
    proto_str(&mut proto, 1, &no);
    proto_varint_field(&mut proto, 2, amount as u64);
    proto_str(&mut proto, 3, "CNY");
    proto_varint_field(&mut proto, 4, 1);
    proto_varint_field(&mut proto, 5, 1_796_466_600_000);
    let mut buyer = Vec::new();
    proto_str(&mut buyer, 1, "u-7");
    proto_str(&mut buyer, 2, "vip");
    proto_str(&mut buyer, 2, "cn");
    proto_bytes(&mut proto, 6, &buyer);
    [json.to_string().into_bytes(), avro, proto]
}

fn varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn zigzag(out: &mut Vec<u8>, n: i64) {
    varint(out, ((n << 1) ^ (n >> 63)) as u64);
}

fn avro_str(out: &mut Vec<u8>, s: &str) {
    zigzag(out, s.len() as i64);
    out.extend_from_slice(s.as_bytes());
}

fn proto_varint_field(out: &mut Vec<u8>, field: u64, n: u64) {
    varint(out, field << 3);
    varint(out, n);
}

fn proto_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn proto_str(out: &mut Vec<u8>, field: u64, s: &str) {
    proto_bytes(out, field, s.as_bytes());
}

/// The loopback registry; its URL.
async fn registry() -> Res<String> {
    let app = Router::new().route(
        "/schemas/ids/{id}",
        get(|Path(id): Path<u32>| async move {
            let answer = match id {
                1 => serde_json::json!({"schema": AVRO}),
                2 => serde_json::json!({"schema": PROTO, "schemaType": "PROTOBUF"}),
                _ => serde_json::json!({"error_code": 40403, "message": "not found"}),
            };
            axum::Json(answer)
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(url)
}

fn per_message(total: Duration, n: usize) -> Duration {
    total / u32::try_from(n).unwrap_or(u32::MAX).max(1)
}

fn us(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

pub(super) async fn run(b: &mut Bench) -> Res<()> {
    let (decodes, claims) = match b.mode {
        Mode::Quick => (2_000, 100),
        Mode::Default => (50_000, 2_000),
        Mode::Full => (500_000, 5_000),
    };
    let url = registry().await?;
    let decoder = SchemaRegistry::builder(&url).build()?;
    let payloads: Vec<[Vec<u8>; 3]> = (0..decodes).map(|i| payment(i, "D")).collect();
    // Warm the schema cache; check that the three encodings agree.
    let [json, avro, proto] = &payloads[0];
    let want: serde_json::Value = serde_json::from_slice(json)?;
    let got_avro = decoder
        .decode(&Delivery::new(avro.clone()))
        .await?
        .unwrap_or_default();
    let got_proto = decoder
        .decode(&Delivery::new(proto.clone()))
        .await?
        .unwrap_or_default();
    b.check(got_avro == want, || {
        format!("Avro read {got_avro}, not {want}")
    });
    let mut proto_want = want.clone();
    proto_want["memo"] = serde_json::json!("");
    b.check(got_proto == proto_want, || {
        format!("Protobuf read {got_proto}")
    });

    let mut table = Table::new(
        format!(
            "Schema Registry payloads: decoding {decodes} records (µs each), and {claims} sequential claims with the decoded key (Postgres)"
        ),
        &[
            "payload",
            "decode",
            "decode vs JSON",
            "claims/s",
            "claims/s vs JSON",
        ],
    );
    let mut decode_cost = Vec::new();
    for (index, name) in ["JSON (baseline)", "Avro", "Protobuf"].iter().enumerate() {
        let started = Instant::now();
        for p in &payloads {
            let delivery = Delivery::new(p[index].clone());
            let tree = if index == 0 {
                serde_json::from_slice::<serde_json::Value>(delivery.payload())?
            } else {
                decoder.decode(&delivery).await?.unwrap_or_default()
            };
            std::hint::black_box(tree);
        }
        decode_cost.push((name, per_message(started.elapsed(), decodes)));
    }

    let schema = b.schema("registry").await?;
    let db = pool(&schema.url, 2).await?;
    let store = PgStore::new(db.clone());
    store.migrate().await?;
    let mut rates = Vec::new();
    for (index, _) in decode_cost.iter().enumerate() {
        let mut builder = Engine::builder(store.clone())
            .scope(format!("bench-{index}"))
            .key_expr("json:/out_trade_no");
        if index > 0 {
            builder = builder.payload_decoder(decoder.clone());
        }
        let engine = builder.build()?;
        let claims_of: Vec<Vec<u8>> = (0..claims)
            .map(|i| payment(i, &format!("C{index}"))[index].clone())
            .collect();
        let started = Instant::now();
        for payload in claims_of {
            let report = engine.process(&Noop, &Delivery::new(payload)).await;
            b.check(report.outcome.is_done(), || {
                format!("claim failed: {:?}", report.outcome)
            });
        }
        rates.push(claims as f64 / started.elapsed().as_secs_f64());
    }
    let (_, json_cost) = decode_cost[0];
    for ((name, cost), rate) in decode_cost.iter().zip(&rates) {
        table.row(vec![
            (*name).to_string(),
            us(*cost),
            format!("{:.2}×", cost.as_secs_f64() / json_cost.as_secs_f64()),
            format!("{rate:.0}"),
            format!("{:.2}×", rate / rates[0]),
        ]);
    }
    b.table(table);
    b.drop_schema(&schema).await;
    Ok(())
}
