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
                use sqlx::Row as _;
                let row = sqlx::query(&self.sql.get)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(&self.pool)
                    .await?;
                let Some(row) = row else { return Ok(None) };
                let fingerprint: Option<Vec<u8>> = row.try_get("fingerprint")?;
                Ok(Some($crate::store::Record {
                    scope: row.try_get("scope")?,
                    key: row.try_get("idem_key")?,
                    fingerprint: fingerprint
                        .as_deref()
                        .and_then($crate::fingerprint::Fingerprint::from_slice),
                    result: row.try_get("result")?,
                    source: row.try_get("source")?,
                    created_at_ms: row.try_get("created_at_ms")?,
                    expires_at_ms: row.try_get("expires_at_ms")?,
                }))
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
