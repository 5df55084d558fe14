//! A PostgreSQL database of its own on the shared server, for tests that
//! turn it read-only or change its privileges without disturbing others.

use sqlx::PgPool;

use crate::{pg_url, unique};

/// A fresh database on the server of [`pg_url`]; the admin pool is the
/// superuser connection the tests use to change it.
pub struct OwnDb {
    /// A connection to the server's default database, as the test's superuser.
    pub admin: PgPool,
    /// The database's name.
    pub name: String,
    /// A URL of the database, as the test's superuser.
    pub url: String,
}

impl OwnDb {
    /// Creates a database named after `prefix`.
    pub async fn create(prefix: &str) -> Self {
        let admin = PgPool::connect(&pg_url()).await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {}: {e}; start it with scripts/services",
                pg_url()
            )
        });
        let name = unique(prefix);
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .expect("create database");
        let base = pg_url();
        let root = base.rsplit_once('/').map_or(base.as_str(), |(r, _)| r);
        let url = format!("{root}/{name}");
        Self { admin, name, url }
    }

    /// What a failover to a read-only server looks like to clients: every
    /// connection drops, and the new ones cannot write.
    pub async fn fail_over_read_only(&self) {
        self.set_read_only(true).await;
        self.terminate_connections().await;
    }

    /// Makes new sessions read-only (`on`) or writable again.
    pub async fn set_read_only(&self, on: bool) {
        let value = if on { "on" } else { "off" };
        sqlx::query(&format!(
            "ALTER DATABASE {} SET default_transaction_read_only = {value}",
            self.name
        ))
        .execute(&self.admin)
        .await
        .expect("alter database");
    }

    /// Ends every other session of the database.
    pub async fn terminate_connections(&self) {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(&self.name)
        .execute(&self.admin)
        .await
        .expect("terminate connections");
    }
}
