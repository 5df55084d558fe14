//! The bench's business writes: a payment makes one `ledger` row and adds
//! its amount to the account's balance in `accounts`; an order is one
//! `orders` row. The same statements as the demo apps' ledger
//! (`integration-tests/src/demo/ledger.rs`), so the consumers measured do
//! the work those apps do.

use serde::{Deserialize, Serialize};

/// One payment.
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

/// SQLite flavour.
pub mod sqlite {
    use super::{NewOrder, Order};
    use sqlx::{SqliteConnection, SqlitePool};

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
}

/// Postgres flavour.
pub mod postgres {
    use super::{NewOrder, Order, Payment};
    use sqlx::{PgConnection, PgPool};

    /// Creates the ledger tables if missing; creation is serialized by a
    /// transaction-scoped advisory lock (`CREATE TABLE IF NOT EXISTS`
    /// races in Postgres).
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

    /// Records `p` on the open transaction `conn`: its ledger row and the
    /// account's new balance.
    pub async fn record(conn: &mut PgConnection, p: &Payment) -> sqlx::Result<()> {
        let _ledger_id: i64 = sqlx::query_scalar(
            "INSERT INTO ledger (out_trade_no, account, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(&p.out_trade_no)
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *conn)
        .await?;
        let _balance: i64 = sqlx::query_scalar(
            "INSERT INTO accounts (account, balance) VALUES ($1, $2) \
             ON CONFLICT (account) DO UPDATE SET balance = accounts.balance + excluded.balance \
             RETURNING balance",
        )
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *conn)
        .await?;
        Ok(())
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
}
