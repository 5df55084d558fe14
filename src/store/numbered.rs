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

/// Implements [`AdminStore`](crate::store::admin::AdminStore) for a
/// `$n`-dialect store whose text columns decode as `String`.
macro_rules! numbered_admin {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::admin::AdminStore for $store {
            async fn stats(
                &self,
                scope: Option<&str>,
                now_ms: i64,
            ) -> Result<Vec<$crate::store::admin::ScopeStats>, $crate::store::StoreError> {
                use sqlx::Row as _;
                let sql = $crate::store::admin::stats_sql(
                    $crate::store::admin::Dialect::Numbered,
                    &self.table.quoted('"'),
                    scope.is_some(),
                );
                let mut query = sqlx::query(&sql);
                for _ in 0..7 {
                    query = query.bind(now_ms);
                }
                if let Some(scope) = scope {
                    query = query.bind(scope);
                }
                let rows = query.fetch_all(&self.pool).await?;
                rows.iter()
                    .map(|row| {
                        let younger = [
                            row.try_get::<i64, _>("b0")?,
                            row.try_get("b1")?,
                            row.try_get("b2")?,
                            row.try_get("b3")?,
                            row.try_get("b4")?,
                        ];
                        Ok($crate::store::admin::ScopeStats {
                            scope: row.try_get("scope")?,
                            records: row.try_get("records")?,
                            expired: row.try_get("expired")?,
                            without_result: row.try_get("without_result")?,
                            oldest_ms: row.try_get("oldest")?,
                            newest_ms: row.try_get("newest")?,
                            age_buckets: $crate::store::admin::buckets(younger, row.try_get("b5")?),
                        })
                    })
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(Into::into)
            }

            async fn find(
                &self,
                filter: &$crate::store::admin::RecordFilter,
            ) -> Result<Vec<$crate::store::Record>, $crate::store::StoreError> {
                use sqlx::Row as _;
                let sql = $crate::store::admin::find_sql(
                    $crate::store::admin::Dialect::Numbered,
                    &self.table.quoted('"'),
                    filter,
                );
                let pattern = filter
                    .source_prefix
                    .as_deref()
                    .map($crate::store::admin::like_prefix);
                let mut query = sqlx::query(&sql);
                if let Some(scope) = &filter.scope {
                    query = query.bind(scope);
                }
                if let Some(key) = &filter.key {
                    query = query.bind(key);
                }
                if let Some(pattern) = &pattern {
                    query = query.bind(pattern);
                }
                let rows = query
                    .bind(i64::from(filter.limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter()
                    .map(|row| {
                        let fingerprint: Option<Vec<u8>> = row.try_get("fingerprint")?;
                        Ok($crate::store::Record {
                            scope: row.try_get("scope")?,
                            key: row.try_get("idem_key")?,
                            fingerprint: fingerprint
                                .as_deref()
                                .and_then($crate::fingerprint::Fingerprint::from_slice),
                            result: row.try_get("result")?,
                            source: row.try_get("source")?,
                            created_at_ms: row.try_get("created_at_ms")?,
                            expires_at_ms: row.try_get("expires_at_ms")?,
                        })
                    })
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(Into::into)
            }

            async fn count(
                &self,
                scope: Option<&str>,
                which: $crate::store::admin::Count,
            ) -> Result<u64, $crate::store::StoreError> {
                let sql = $crate::store::admin::count_sql(
                    $crate::store::admin::Dialect::Numbered,
                    &self.table.quoted('"'),
                    scope.is_some(),
                    which,
                );
                let mut query = sqlx::query_scalar::<_, i64>(&sql);
                if let Some(scope) = scope {
                    query = query.bind(scope);
                }
                if let Some(t) = which.time() {
                    query = query.bind(t);
                }
                let n = query.fetch_one(&self.pool).await?;
                Ok(u64::try_from(n).unwrap_or(0))
            }

            async fn purge_created_before(
                &self,
                scope: Option<&str>,
                cutoff_ms: i64,
                after: Option<&$crate::store::admin::PurgeCursor>,
                batch: u32,
            ) -> Result<$crate::store::admin::PurgeStep, $crate::store::StoreError> {
                use sqlx::Row as _;
                let sql = $crate::store::admin::purge_sql(
                    $crate::store::admin::Dialect::Numbered,
                    &self.table.quoted('"'),
                    scope.is_some(),
                    after.is_some(),
                );
                let mut chunk = sqlx::query(&sql.chunk);
                if let Some(scope) = scope {
                    chunk = chunk.bind(scope);
                }
                if let Some(c) = after {
                    chunk = chunk.bind(&c.scope).bind(&c.scope).bind(&c.key);
                }
                let rows = chunk
                    .bind(i64::from(batch.max(1)))
                    .fetch_all(&self.pool)
                    .await?;
                let Some(last) = rows.last() else {
                    return Ok($crate::store::admin::PurgeStep {
                        scanned: 0,
                        deleted: 0,
                        next: None,
                    });
                };
                let upper = $crate::store::admin::PurgeCursor {
                    scope: last.try_get("scope")?,
                    key: last.try_get("idem_key")?,
                };
                let mut delete = sqlx::query(&sql.delete).bind(cutoff_ms);
                if let Some(scope) = scope {
                    delete = delete.bind(scope);
                }
                if let Some(c) = after {
                    delete = delete.bind(&c.scope).bind(&c.scope).bind(&c.key);
                }
                let deleted = delete
                    .bind(&upper.scope)
                    .bind(&upper.scope)
                    .bind(&upper.key)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                let scanned = rows.len() as u64;
                Ok($crate::store::admin::PurgeStep {
                    scanned,
                    deleted,
                    next: (scanned >= u64::from(batch.max(1))).then_some(upper),
                })
            }
        }
    };
}

pub(crate) use numbered_admin;
