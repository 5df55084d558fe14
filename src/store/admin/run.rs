//! The operations queries run on a backend's pool, once for every backend.

use sqlx::{Encode, Executor, IntoArguments, Type};

use super::query::AdminQuery;
use super::{CountFilter, PurgeCursor, PurgeStep, RecordFilter, ScopeStats, count_of, purge_step};
use crate::store::backend::Backend;
use crate::store::base::SqlBase;
use crate::store::deadline::within;
use crate::store::rows::StoreRow;
use crate::store::{Record, StoreError};

impl<DB> SqlBase<DB>
where
    DB: Backend,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Row: StoreRow,
{
    /// [`AdminStore::check_columns`](super::AdminStore::check_columns).
    pub async fn check_columns(&self) -> Result<(), StoreError> {
        let mut q = AdminQuery::<DB>::check(&self.quoted_table());
        let rows = DB::build(&mut q.qb).fetch_all(&self.pool);
        within(self.pool_bound(), "column check", rows).await?;
        // The attempts table next to it (crash counting of suspects).
        let attempts = self.table.attempts().quoted(DB::DIALECT.quote());
        let sql =
            format!("SELECT scope, idem_key, attempts, expires_at_ms FROM {attempts} WHERE 1 = 0");
        let rows = sqlx::query(&sql).fetch_all(&self.pool);
        within(self.pool_bound(), "attempts table check", rows).await?;
        // The fence and steps tables.
        let q = DB::DIALECT.quote();
        for (table, columns) in [
            (self.table.fence(), "scope, entity, ord, expires_at_ms"),
            (
                self.table.steps(),
                "scope, idem_key, step, fingerprint, result, created_at_ms, expires_at_ms",
            ),
        ] {
            let sql = format!("SELECT {columns} FROM {} WHERE 1 = 0", table.quoted(q));
            let rows = sqlx::query(&sql).fetch_all(&self.pool);
            within(self.pool_bound(), "side table check", rows).await?;
        }
        Ok(())
    }

    /// [`AdminStore::stats`](super::AdminStore::stats).
    pub async fn stats(
        &self,
        scope: Option<&str>,
        now_ms: i64,
    ) -> Result<Vec<ScopeStats>, StoreError> {
        let mut q = AdminQuery::<DB>::stats(&self.quoted_table(), scope, now_ms);
        let rows = DB::build(&mut q.qb).fetch_all(&self.pool);
        let rows = within(self.pool_bound(), "stats", rows).await?;
        rows.iter().map(StoreRow::scope_stats).collect()
    }

    /// [`AdminStore::find`](super::AdminStore::find).
    pub async fn find(&self, filter: &RecordFilter) -> Result<Vec<Record>, StoreError> {
        let mut q = AdminQuery::<DB>::find(&self.quoted_table(), filter);
        let rows = DB::build(&mut q.qb).fetch_all(&self.pool);
        let rows = within(self.pool_bound(), "find", rows).await?;
        rows.iter().map(StoreRow::record).collect()
    }

    /// [`AdminStore::count`](super::AdminStore::count).
    pub async fn count(&self, scope: Option<&str>, which: CountFilter) -> Result<u64, StoreError> {
        let mut q = AdminQuery::<DB>::count(&self.quoted_table(), scope, which);
        let row = DB::build(&mut q.qb).fetch_one(&self.pool);
        let row = within(self.pool_bound(), "count", row).await?;
        Ok(count_of(row.int("n")?))
    }

    /// [`AdminStore::purge_created_before`](super::AdminStore::purge_created_before).
    pub async fn purge_created_before(
        &self,
        scope: Option<&str>,
        cutoff_ms: i64,
        after: Option<&PurgeCursor>,
        batch: u32,
    ) -> Result<PurgeStep, StoreError> {
        let t = self.quoted_table();
        let mut chunk = AdminQuery::<DB>::purge_chunk(&t, scope, after, batch);
        let rows = DB::build(&mut chunk.qb).fetch_all(&self.pool);
        let rows = within(self.pool_bound(), "purge", rows).await?;
        let Some(last) = rows.last() else {
            return Ok(purge_step(0, 0, None, batch));
        };
        let upto = PurgeCursor {
            scope: last.text("scope")?,
            key: last.text("idem_key")?,
        };
        let deleted = self.delete_chunk(scope, cutoff_ms, after, &upto).await?;
        Ok(purge_step(rows.len(), deleted, Some(upto), batch))
    }

    /// Deletes the old records of one chunk's key range, in the
    /// transaction the backend wants for it.
    async fn delete_chunk(
        &self,
        scope: Option<&str>,
        cutoff_ms: i64,
        after: Option<&PurgeCursor>,
        upto: &PurgeCursor,
    ) -> Result<u64, StoreError> {
        let t = self.quoted_table();
        let mut delete = AdminQuery::<DB>::purge_delete(&t, scope, cutoff_ms, after, upto);
        let delete = DB::build(&mut delete.qb);
        let done = within(self.pool_bound(), "purge", async {
            match DB::PURGE_BEGIN {
                Some(begin) => {
                    let mut tx = self.pool.begin_with(begin).await?;
                    let done = delete.execute(&mut *tx).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(done)
                }
                None => delete.execute(&self.pool).await,
            }
        })
        .await?;
        Ok(DB::rows_affected(&done))
    }
}
