//! Code shared by the stores whose SQL dialect uses `$n` placeholders
//! (Postgres and SQLite): the claim steps and the simple statements. The
//! statements themselves come from [`Sql`](super::sql::Sql); only the driver
//! types differ, so a macro stamps the same code out per backend.

/// Implements `ClaimSteps` and inherent `complete_in` / `get_in` /
/// `purge_in` helpers for a `$n`-dialect store with fields `pool`, `sql`.
macro_rules! numbered_store {
    ($store:ty, $conn:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::claim::ClaimSteps for $store {
            type Conn = $conn;

            async fn insert(
                &self,
                conn: &mut $conn,
                scope: &str,
                times: $crate::store::ClaimTimes,
                req: &$crate::store::ClaimRequest<'_>,
            ) -> Result<bool, $crate::store::StoreError> {
                if let Some(wait) = req
                    .lock_wait
                    .filter(|_| !self.sql.insert_waiting.is_empty())
                {
                    let written: i64 = sqlx::query_scalar(&self.sql.insert_waiting)
                        .bind(scope)
                        .bind(req.key)
                        .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
                        .bind(req.source.map($crate::store::clamp_source))
                        .bind(times.now_ms)
                        .bind(times.expires_at_ms)
                        .bind($crate::store::sql::lock_timeout_value(wait))
                        .fetch_one(&mut *conn)
                        .await?;
                    return Ok(written == 1);
                }
                let row = sqlx::query(&self.sql.insert)
                    .bind(scope)
                    .bind(req.key)
                    .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
                    .bind(req.source.map($crate::store::clamp_source))
                    .bind(times.now_ms)
                    .bind(times.expires_at_ms)
                    .fetch_optional(&mut *conn)
                    .await?;
                Ok(row.is_some())
            }

            async fn existing(
                &self,
                conn: &mut $conn,
                scope: &str,
                key: &str,
            ) -> Result<Option<$crate::store::claim::Existing>, $crate::store::StoreError> {
                use sqlx::Row as _;
                let row = sqlx::query(&self.sql.existing)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
                let Some(row) = row else { return Ok(None) };
                Ok(Some($crate::store::claim::Existing {
                    fingerprint: row.try_get("fingerprint")?,
                    result: row.try_get("result")?,
                    expires_at_ms: row.try_get("expires_at_ms")?,
                }))
            }

            async fn reclaim(
                &self,
                conn: &mut $conn,
                scope: &str,
                times: $crate::store::ClaimTimes,
                req: &$crate::store::ClaimRequest<'_>,
            ) -> Result<bool, $crate::store::StoreError> {
                if let Some(wait) = req
                    .lock_wait
                    .filter(|_| !self.sql.reclaim_waiting.is_empty())
                {
                    let written: i64 = sqlx::query_scalar(&self.sql.reclaim_waiting)
                        .bind(scope)
                        .bind(req.key)
                        .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
                        .bind(req.source.map($crate::store::clamp_source))
                        .bind(times.now_ms)
                        .bind(times.expires_at_ms)
                        .bind($crate::store::sql::lock_timeout_value(wait))
                        .fetch_one(&mut *conn)
                        .await?;
                    return Ok(written == 1);
                }
                let done = sqlx::query(&self.sql.reclaim)
                    .bind(scope)
                    .bind(req.key)
                    .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
                    .bind(req.source.map($crate::store::clamp_source))
                    .bind(times.now_ms)
                    .bind(times.expires_at_ms)
                    .execute(&mut *conn)
                    .await?;
                Ok(done.rows_affected() == 1)
            }
        }

        impl $store {
            async fn complete_in(
                &self,
                conn: &mut $conn,
                scope: &str,
                key: &str,
                result: &[u8],
            ) -> Result<(), $crate::store::StoreError> {
                let done = sqlx::query(&self.sql.complete)
                    .bind(scope)
                    .bind(key)
                    .bind(result)
                    .execute(&mut *conn)
                    .await?;
                $crate::store::expect_one(done.rows_affected(), key)
            }

            async fn get_in(
                &self,
                scope: &str,
                key: &str,
            ) -> Result<Option<$crate::store::Record>, $crate::store::StoreError> {
                use $crate::store::rows::StoreRow as _;
                let row = sqlx::query(&self.sql.get)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(|r| r.record()).transpose()
            }

            async fn purge_in(
                &self,
                scope: Option<&str>,
                now_ms: i64,
                limit: u32,
            ) -> Result<u64, $crate::store::StoreError> {
                let sql = if scope.is_some() {
                    &self.sql.purge_scope
                } else {
                    &self.sql.purge
                };
                let mut query = sqlx::query(sql).bind(now_ms).bind(i64::from(limit));
                if let Some(scope) = scope {
                    query = query.bind(scope);
                }
                Ok(query.execute(&self.pool).await?.rows_affected())
            }
        }
    };
}

pub(crate) use numbered_store;

/// Implements [`AdminStore`](crate::store::admin::AdminStore) for a
/// `$n`-dialect store whose text columns decode as `String`.
macro_rules! numbered_admin {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::admin::AdminStore for $store {
            async fn check_columns(&self) -> Result<(), $crate::store::StoreError> {
                sqlx::query(&$crate::store::admin::check_sql(&self.table.quoted('"')))
                    .fetch_all(&self.pool)
                    .await?;
                Ok(())
            }

            async fn stats(
                &self,
                scope: Option<&str>,
                now_ms: i64,
            ) -> Result<Vec<$crate::store::admin::ScopeStats>, $crate::store::StoreError> {
                use $crate::store::admin;
                use $crate::store::rows::StoreRow as _;
                let stmt = admin::stats_stmt(
                    admin::Dialect::Numbered,
                    &self.table.quoted('"'),
                    scope,
                    now_ms,
                );
                let rows = admin::bind_all!(sqlx::query(&stmt.sql), stmt)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| row.scope_stats()).collect()
            }

            async fn find(
                &self,
                filter: &$crate::store::admin::RecordFilter,
            ) -> Result<Vec<$crate::store::Record>, $crate::store::StoreError> {
                use $crate::store::admin;
                use $crate::store::rows::StoreRow as _;
                let stmt =
                    admin::find_stmt(admin::Dialect::Numbered, &self.table.quoted('"'), filter);
                let rows = admin::bind_all!(sqlx::query(&stmt.sql), stmt)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| row.record()).collect()
            }

            async fn count(
                &self,
                scope: Option<&str>,
                which: $crate::store::admin::CountFilter,
            ) -> Result<u64, $crate::store::StoreError> {
                use $crate::store::admin;
                let stmt = admin::count_stmt(
                    admin::Dialect::Numbered,
                    &self.table.quoted('"'),
                    scope,
                    which,
                );
                let n: i64 = admin::bind_all!(sqlx::query_scalar(&stmt.sql), stmt)
                    .fetch_one(&self.pool)
                    .await?;
                Ok(admin::count_of(n))
            }

            async fn purge_created_before(
                &self,
                scope: Option<&str>,
                cutoff_ms: i64,
                after: Option<&$crate::store::admin::PurgeCursor>,
                batch: u32,
            ) -> Result<$crate::store::admin::PurgeStep, $crate::store::StoreError> {
                use $crate::store::admin::{self, PurgeCursor};
                let t = self.table.quoted('"');
                let chunk =
                    admin::purge_chunk_stmt(admin::Dialect::Numbered, &t, scope, after, batch);
                let rows = admin::bind_all!(sqlx::query(&chunk.sql), chunk)
                    .fetch_all(&self.pool)
                    .await?;
                let Some(last) = rows.last() else {
                    return Ok(admin::purge_step(0, 0, None, batch));
                };
                let upto = PurgeCursor {
                    scope: $crate::store::rows::StoreRow::text(last, "scope")?,
                    key: $crate::store::rows::StoreRow::text(last, "idem_key")?,
                };
                let delete = admin::purge_delete_stmt(
                    admin::Dialect::Numbered,
                    &t,
                    scope,
                    cutoff_ms,
                    after,
                    &upto,
                );
                let deleted = admin::bind_all!(sqlx::query(&delete.sql), delete)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                Ok(admin::purge_step(rows.len(), deleted, Some(upto), batch))
            }
        }
    };
}

pub(crate) use numbered_admin;
