//! The payments ledger shared by the demo apps and the tests: one JSON
//! payment message (`out_trade_no`, `account`, `amount`) becomes one
//! `ledger` row and adds `amount` to the account's balance in `accounts`.
//!
//! `ledger.out_trade_no` deliberately has no unique constraint: the demo
//! apps prove that onceonly, not the business table, prevents double
//! charges.

use serde::{Deserialize, Serialize};

/// One payment notification.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Payment {
    /// The merchant's order number: the idempotency key.
    pub out_trade_no: String,
    /// The account to credit.
    pub account: String,
    /// The amount in minor units.
    pub amount: i64,
}

/// A new order, as `POST /orders` receives it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NewOrder {
    /// The ordering account.
    pub account: String,
    /// The amount in minor units.
    pub amount: i64,
}

/// An order as stored, with its server-generated id.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Order {
    /// Server-generated id.
    pub id: i64,
    /// The ordering account.
    pub account: String,
    /// The amount in minor units.
    pub amount: i64,
}

/// What the handler returns and onceonly stores: duplicates get it back.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Receipt {
    /// The id of the ledger row.
    pub ledger_id: i64,
    /// The account balance right after this payment.
    pub balance: i64,
}

/// The "payment settled" message the examples send through the outbox for
/// each processed payment (Kafka record keyed by account, AMQP message
/// routed by account, or merchant webhook).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Settled {
    /// The merchant's order number.
    pub out_trade_no: String,
    /// The account credited.
    pub account: String,
    /// The amount in minor units.
    pub amount: i64,
    /// The account balance right after this payment.
    pub balance: i64,
}

impl Settled {
    /// The message for payment `p` recorded with receipt `r`.
    pub fn new(p: &Payment, r: &Receipt) -> Self {
        Self {
            out_trade_no: p.out_trade_no.clone(),
            account: p.account.clone(),
            amount: p.amount,
            balance: r.balance,
        }
    }

    /// Its JSON body.
    pub fn body(&self) -> String {
        // A struct of strings and integers always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// SQLite flavour of the ledger.
pub mod sqlite {
    use super::{NewOrder, Order, Payment, Receipt};
    use sqlx::{SqliteConnection, SqlitePool};

    /// Creates the ledger tables if missing.
    pub async fn create_tables(pool: &SqlitePool) -> sqlx::Result<()> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, \
             out_trade_no TEXT NOT NULL, account TEXT NOT NULL, amount INTEGER NOT NULL)",
        )
        .execute(pool)
        .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS accounts (account TEXT PRIMARY KEY, balance INTEGER NOT NULL)",
        )
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Records `p` on the open transaction `conn`.
    pub async fn record(conn: &mut SqliteConnection, p: &Payment) -> sqlx::Result<Receipt> {
        let ledger_id: i64 = sqlx::query_scalar(
            "INSERT INTO ledger (out_trade_no, account, amount) VALUES (?, ?, ?) RETURNING id",
        )
        .bind(&p.out_trade_no)
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *conn)
        .await?;
        let balance: i64 = sqlx::query_scalar(
            "INSERT INTO accounts (account, balance) VALUES (?, ?) \
             ON CONFLICT (account) DO UPDATE SET balance = balance + excluded.balance \
             RETURNING balance",
        )
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *conn)
        .await?;
        Ok(Receipt { ledger_id, balance })
    }

    /// Creates the `orders` table if missing.
    pub async fn create_orders_table(pool: &SqlitePool) -> sqlx::Result<()> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT, \
             account TEXT NOT NULL, amount INTEGER NOT NULL)",
        )
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Inserts an order on the open transaction `conn`.
    pub async fn insert_order(conn: &mut SqliteConnection, o: &NewOrder) -> sqlx::Result<Order> {
        let id: i64 =
            sqlx::query_scalar("INSERT INTO orders (account, amount) VALUES (?, ?) RETURNING id")
                .bind(&o.account)
                .bind(o.amount)
                .fetch_one(&mut *conn)
                .await?;
        Ok(Order {
            id,
            account: o.account.clone(),
            amount: o.amount,
        })
    }

    /// `(out_trade_no, times charged, total amount)` for every key, sorted.
    pub async fn charges(pool: &SqlitePool) -> sqlx::Result<Vec<(String, i64, i64)>> {
        sqlx::query_as(
            "SELECT out_trade_no, COUNT(*), SUM(amount) FROM ledger GROUP BY out_trade_no ORDER BY out_trade_no",
        )
        .fetch_all(pool)
        .await
    }

    /// `(account, balance)` for every account, sorted.
    pub async fn balances(pool: &SqlitePool) -> sqlx::Result<Vec<(String, i64)>> {
        sqlx::query_as("SELECT account, balance FROM accounts ORDER BY account")
            .fetch_all(pool)
            .await
    }
}

/// Postgres flavour of the ledger.
pub mod postgres {
    use super::{NewOrder, Order, Payment, Receipt, Settled};
    use onceonly::outbox::{Outbox, OutboxMessage};
    use onceonly::{Delivery, Handler, HandlerError, Json};
    use sqlx::{PgConnection, PgPool, Postgres};

    /// The handler the Kafka and AMQP examples run: credits the ledger
    /// inside the claim's transaction. A non-positive amount is a permanent
    /// error (dead-lettered); database errors are retryable when transient.
    pub struct Ledger;

    #[async_trait::async_trait]
    impl Handler<Postgres> for Ledger {
        type Input = Json<Payment>;
        type Output = Receipt;

        async fn handle(
            &self,
            tx: onceonly::Tx<sqlx::Postgres>,
            Json(payment): Json<Payment>,
            _delivery: &Delivery,
        ) -> Result<Receipt, HandlerError> {
            let mut conn = tx.lock().await?;
            credit(&mut conn, &payment).await
        }
    }

    /// Refuses a non-positive amount (a permanent error), else records the
    /// payment on the open transaction `conn`.
    async fn credit(conn: &mut PgConnection, payment: &Payment) -> Result<Receipt, HandlerError> {
        if payment.amount <= 0 {
            return Err(HandlerError::permanent(format!(
                "amount must be positive, got {}",
                payment.amount
            )));
        }
        Ok(record(conn, payment).await?)
    }

    /// Where [`SettlingLedger`] sends each payment's [`Settled`] message.
    #[derive(Clone, Debug)]
    pub enum SettledTo {
        /// A Kafka topic; records are keyed by account.
        Kafka(String),
        /// An AMQP exchange; the routing key is the account.
        Amqp(String),
    }

    impl SettledTo {
        /// The outbox message of `settled`.
        pub fn message(&self, settled: &Settled) -> OutboxMessage {
            match self {
                Self::Kafka(topic) => {
                    OutboxMessage::kafka(topic, settled.account.as_bytes(), settled.body())
                }
                Self::Amqp(exchange) => {
                    OutboxMessage::amqp(exchange, &settled.account, settled.body())
                }
            }
        }
    }

    /// The [`Ledger`] that also announces each processed payment: in the
    /// same transaction as the ledger row, it enqueues one [`Settled`]
    /// message in `outbox`, which a relay sends once the transaction
    /// committed (never for a payment that was refused or rolled back).
    #[derive(Clone, Debug)]
    pub struct SettlingLedger {
        /// The outbox the messages are enqueued in.
        pub outbox: Outbox<Postgres>,
        /// Where they go.
        pub to: SettledTo,
    }

    #[async_trait::async_trait]
    impl Handler<Postgres> for SettlingLedger {
        type Input = Json<Payment>;
        type Output = Receipt;

        async fn handle(
            &self,
            tx: onceonly::Tx<sqlx::Postgres>,
            Json(payment): Json<Payment>,
            _delivery: &Delivery,
        ) -> Result<Receipt, HandlerError> {
            let mut conn = tx.lock().await?;
            let receipt = credit(&mut conn, &payment).await?;
            let settled = Settled::new(&payment, &receipt);
            self.outbox
                .enqueue(&mut conn, self.to.message(&settled))
                .await?;
            Ok(receipt)
        }
    }

    /// Connects to `url` and creates the dedup table and the ledger tables
    /// if missing.
    pub async fn open(url: &str) -> Result<onceonly::PgStore, Box<dyn std::error::Error>> {
        use onceonly::SqlStore;
        let store = onceonly::PgStore::connect(url).await?;
        store.migrate().await?;
        create_tables(store.pool()).await?;
        Ok(store)
    }

    /// Creates the ledger tables if missing. Several processes may start at
    /// once: `CREATE TABLE IF NOT EXISTS` races in Postgres, so creation is
    /// serialized by a transaction-scoped advisory lock.
    pub async fn create_tables(pool: &PgPool) -> sqlx::Result<()> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('onceonly-example-ledger'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS ledger (id BIGSERIAL PRIMARY KEY, \
             out_trade_no TEXT NOT NULL, account TEXT NOT NULL, amount BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS accounts (account TEXT PRIMARY KEY, balance BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }

    /// Records `p` on the open transaction `conn`.
    pub async fn record(conn: &mut PgConnection, p: &Payment) -> sqlx::Result<Receipt> {
        let ledger_id: i64 = sqlx::query_scalar(
            "INSERT INTO ledger (out_trade_no, account, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(&p.out_trade_no)
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *conn)
        .await?;
        let balance: i64 = sqlx::query_scalar(
            "INSERT INTO accounts (account, balance) VALUES ($1, $2) \
             ON CONFLICT (account) DO UPDATE SET balance = accounts.balance + excluded.balance \
             RETURNING balance",
        )
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *conn)
        .await?;
        Ok(Receipt { ledger_id, balance })
    }

    /// Creates the `orders` table if missing.
    pub async fn create_orders_table(pool: &PgPool) -> sqlx::Result<()> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('onceonly-example-orders'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, \
             account TEXT NOT NULL, amount BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }

    /// Inserts an order on the open transaction `conn`.
    pub async fn insert_order(conn: &mut PgConnection, o: &NewOrder) -> sqlx::Result<Order> {
        let id: i64 =
            sqlx::query_scalar("INSERT INTO orders (account, amount) VALUES ($1, $2) RETURNING id")
                .bind(&o.account)
                .bind(o.amount)
                .fetch_one(&mut *conn)
                .await?;
        Ok(Order {
            id,
            account: o.account.clone(),
            amount: o.amount,
        })
    }

    /// `(out_trade_no, times charged, total amount)` for every key, sorted.
    pub async fn charges(pool: &PgPool) -> sqlx::Result<Vec<(String, i64, i64)>> {
        sqlx::query_as(
            "SELECT out_trade_no, COUNT(*), SUM(amount)::BIGINT FROM ledger \
             GROUP BY out_trade_no ORDER BY out_trade_no",
        )
        .fetch_all(pool)
        .await
    }

    /// `(account, balance)` for every account, sorted.
    pub async fn balances(pool: &PgPool) -> sqlx::Result<Vec<(String, i64)>> {
        sqlx::query_as("SELECT account, balance FROM accounts ORDER BY account")
            .fetch_all(pool)
            .await
    }
}
