//! Checks of the examples' Postgres ledger (`ledger`, `accounts`) shared by
//! the transport tests, and the payment streams they send (bodies built with
//! [`crate::pay`]).

use std::collections::BTreeMap;

use sqlx::PgPool;

/// `out_trade_no` -> `(account, amount)` of every distinct payment sent.
pub type Expected = BTreeMap<String, (String, i64)>;

/// Payment messages in sending order, `(out_trade_no, body)`, and what the
/// ledger must hold afterwards.
pub struct Stream {
    /// The messages, duplicates included.
    pub messages: Vec<(String, Vec<u8>)>,
    /// The distinct payments.
    pub expected: Expected,
}

impl Stream {
    /// How many messages are duplicates.
    pub fn duplicates(&self) -> usize {
        self.messages.len() - self.expected.len()
    }
}

/// `distinct` payments over 23 accounts; every fourth is sent again right
/// behind itself and every third again at the end (for 4,800 keys: 2,800
/// duplicates, 37 % of 7,600 messages).
pub fn crash_stream(prefix: &str, distinct: usize) -> Stream {
    let mut messages = Vec::new();
    let mut tail = Vec::new();
    let mut expected = Expected::new();
    for i in 0..distinct {
        let no = format!("{prefix}-{i:06}");
        let account = format!("acct-{}", i % 23);
        let amount = 1 + (i as i64 * 7919) % 1000;
        let body = crate::pay(&no, amount).account(&account).body();
        messages.push((no.clone(), body.clone()));
        if i % 4 == 0 {
            messages.push((no.clone(), body.clone()));
        }
        if i % 3 == 0 {
            tail.push((no.clone(), body));
        }
        expected.insert(no, (account, amount));
    }
    messages.extend(tail);
    Stream { messages, expected }
}

/// Ledger rows so far (0 before the table exists).
pub async fn rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// Asserts one ledger row per expected key with its amount, nothing else,
/// and every account balance.
pub async fn assert_exact(pool: &PgPool, expected: &Expected) {
    let charges: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT out_trade_no, COUNT(*), SUM(amount)::BIGINT FROM ledger \
         GROUP BY out_trade_no ORDER BY out_trade_no",
    )
    .fetch_all(pool)
    .await
    .expect("read ledger");
    let doubled: Vec<_> = charges.iter().filter(|(_, n, _)| *n != 1).take(5).collect();
    assert!(doubled.is_empty(), "charged more than once: {doubled:?}");
    assert_eq!(
        charges.len(),
        expected.len(),
        "ledger rows vs distinct keys"
    );
    let want: Vec<(String, i64, i64)> = expected
        .iter()
        .map(|(no, (_, amount))| (no.clone(), 1, *amount))
        .collect();
    assert_eq!(charges, want, "every key charged exactly once");
    let mut balances: BTreeMap<String, i64> = BTreeMap::new();
    for (account, amount) in expected.values() {
        *balances.entry(account.clone()).or_default() += amount;
    }
    let got: BTreeMap<String, i64> =
        sqlx::query_as("SELECT account, balance FROM accounts ORDER BY account")
            .fetch_all(pool)
            .await
            .expect("read accounts")
            .into_iter()
            .collect();
    assert_eq!(got, balances, "account balances");
}
