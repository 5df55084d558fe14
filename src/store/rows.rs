//! Reading records and statistics out of result rows, once for every
//! backend. Only text columns differ: Postgres and SQLite return `TEXT`,
//! MySQL's byte-exact `VARBINARY` columns return bytes that must be UTF-8
//! ([`Dialect::byte_text`](super::Dialect::byte_text)).

use sqlx::{ColumnIndex, Decode, Row, Type};

use super::admin::{self, ScopeStats};
use super::backend::Backend;
use super::claim::Existing;
use super::steps::{OrphanedStep, StepRecord};
use super::{Record, StoreError};
use crate::fingerprint::Fingerprint;

/// A result row of a store's table.
pub(crate) trait StoreRow {
    /// A nullable text column.
    fn text_opt(&self, column: &str) -> Result<Option<String>, StoreError>;

    /// A text column that is never NULL.
    fn text(&self, column: &str) -> Result<String, StoreError> {
        self.text_opt(column)?
            .ok_or_else(|| StoreError::Corrupt(format!("{column} is NULL")))
    }

    /// What a claim needs of a record (`fingerprint, result, expires_at_ms`).
    fn existing(&self) -> Result<Existing, StoreError>;

    /// A record (`scope, idem_key, fingerprint, source, created_at_ms,
    /// expires_at_ms, result`).
    fn record(&self) -> Result<Record, StoreError>;

    /// An integer column that is never NULL.
    fn int(&self, column: &str) -> Result<i64, StoreError>;

    /// A byte column that is never NULL.
    fn bytes(&self, column: &str) -> Result<Vec<u8>, StoreError>;

    /// A row of the steps table (`step, fingerprint, result,
    /// created_at_ms, expires_at_ms`).
    fn step_record(&self) -> Result<StepRecord, StoreError>;

    /// A row of the orphaned steps query (`scope, idem_key, step,
    /// created_at_ms`).
    fn orphaned_step(&self) -> Result<OrphanedStep, StoreError>;

    /// A row of the statistics query of
    /// [`AdminStore::stats`](super::admin::AdminStore::stats).
    fn scope_stats(&self) -> Result<ScopeStats, StoreError>;
}

impl<R> StoreRow for R
where
    R: Row,
    R::Database: Backend,
    for<'a> &'a str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    fn text_opt(&self, column: &str) -> Result<Option<String>, StoreError> {
        if !<R::Database as Backend>::DIALECT.byte_text() {
            return Ok(self.try_get(column)?);
        }
        let bytes: Option<Vec<u8>> = self.try_get(column)?;
        bytes
            .map(|b| {
                String::from_utf8(b)
                    .map_err(|_| StoreError::Corrupt(format!("{column} is not UTF-8")))
            })
            .transpose()
    }

    fn int(&self, column: &str) -> Result<i64, StoreError> {
        Ok(self.try_get(column)?)
    }

    fn bytes(&self, column: &str) -> Result<Vec<u8>, StoreError> {
        Ok(self.try_get(column)?)
    }

    fn step_record(&self) -> Result<StepRecord, StoreError> {
        let fingerprint: Option<Vec<u8>> = self.try_get("fingerprint")?;
        Ok(StepRecord {
            step: self.text("step")?,
            fingerprint: fingerprint.as_deref().and_then(Fingerprint::from_slice),
            result: self.try_get("result")?,
            created_at_ms: self.try_get("created_at_ms")?,
            expires_at_ms: self.try_get("expires_at_ms")?,
        })
    }

    fn orphaned_step(&self) -> Result<OrphanedStep, StoreError> {
        Ok(OrphanedStep {
            scope: self.text("scope")?,
            key: self.text("idem_key")?,
            step: self.text("step")?,
            created_at_ms: self.try_get("created_at_ms")?,
        })
    }

    fn existing(&self) -> Result<Existing, StoreError> {
        Ok(Existing {
            fingerprint: self.try_get("fingerprint")?,
            result: self.try_get("result")?,
            expires_at_ms: self.try_get("expires_at_ms")?,
        })
    }

    fn record(&self) -> Result<Record, StoreError> {
        let fingerprint: Option<Vec<u8>> = self.try_get("fingerprint")?;
        Ok(Record {
            scope: self.text("scope")?,
            key: self.text("idem_key")?,
            fingerprint: fingerprint.as_deref().and_then(Fingerprint::from_slice),
            result: self.try_get("result")?,
            source: self.text_opt("source")?,
            created_at_ms: self.try_get("created_at_ms")?,
            expires_at_ms: self.try_get("expires_at_ms")?,
        })
    }

    fn scope_stats(&self) -> Result<ScopeStats, StoreError> {
        let younger = [
            self.try_get::<i64, _>("b0")?,
            self.try_get("b1")?,
            self.try_get("b2")?,
            self.try_get("b3")?,
            self.try_get("b4")?,
        ];
        Ok(ScopeStats {
            scope: self.text("scope")?,
            records: admin::count_of(self.try_get("records")?),
            expired: admin::count_of(self.try_get("expired")?),
            without_result: admin::count_of(self.try_get("without_result")?),
            oldest_ms: self.try_get("oldest")?,
            newest_ms: self.try_get("newest")?,
            age_buckets: admin::buckets(younger, self.try_get("b5")?),
        })
    }
}
