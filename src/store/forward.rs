//! Forwarding implementations of [`SqlStore`](super::SqlStore) and
//! [`AdminStore`](super::admin::AdminStore): a store that wraps another one
//! (the backend stores wrap a [`SqlBase`](super::base::SqlBase), the Redis
//! tier wraps any SQL store) forwards every method to it. What differs per
//! database is in [`Backend`](super::backend::Backend), not here.

/// Implements [`SqlStore`](crate::store::SqlStore) for `$store` by
/// forwarding every method to its field `$to`, with `Db = $db`, plus the
/// `$extra` methods (which replace the trait's defaults).
///
/// `forward_sql_store!(impl[<generics>] for Store => field, Db = Database, extra fns...)`
macro_rules! forward_sql_store {
    (
        $(#[$attr:meta])*
        impl[$($gen:tt)*] for $store:ty => $to:ident, Db = $db:ty $(, $extra:item)* $(,)?
    ) => {
        $(#[$attr])*
        impl<$($gen)*> $crate::store::sealed::Sealed for $store {}

        $(#[$attr])*
        #[async_trait::async_trait]
        impl<$($gen)*> $crate::store::SqlStore for $store {
            type Db = $db;

            fn pool(&self) -> &sqlx::Pool<$db> {
                self.$to.pool()
            }

            fn table(&self) -> &$crate::store::TableName {
                self.$to.table()
            }

            async fn migrate(&self) -> Result<(), $crate::store::StoreError> {
                self.$to.migrate().await
            }

            async fn begin(
                &self,
            ) -> Result<sqlx::Transaction<'static, $db>, $crate::store::StoreError> {
                self.$to.begin().await
            }

            fn deadlines(&self) -> $crate::store::Deadlines {
                self.$to.deadlines()
            }

            async fn claim(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                times: $crate::store::ClaimTimes,
                req: &$crate::store::ClaimRequest<'_>,
            ) -> Result<$crate::store::Claim, $crate::store::StoreError> {
                self.$to.claim(conn, scope, times, req).await
            }

            async fn claim_completed(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                times: $crate::store::ClaimTimes,
                req: &$crate::store::ClaimRequest<'_>,
                result: &[u8],
            ) -> Result<$crate::store::Claim, $crate::store::StoreError> {
                self.$to.claim_completed(conn, scope, times, req, result).await
            }

            async fn claim_batch(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                times: $crate::store::ClaimTimes,
                reqs: &[$crate::store::ClaimRequest<'_>],
            ) -> Result<Vec<$crate::store::Claim>, $crate::store::StoreError> {
                self.$to.claim_batch(conn, scope, times, reqs).await
            }

            async fn lookup_batch(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                times: $crate::store::ClaimTimes,
                reqs: &[$crate::store::ClaimRequest<'_>],
            ) -> Result<Vec<$crate::store::Claim>, $crate::store::StoreError> {
                self.$to.lookup_batch(conn, scope, times, reqs).await
            }

            async fn claim_completed_batch(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                times: $crate::store::ClaimTimes,
                reqs: &[$crate::store::ClaimRequest<'_>],
                results: &[&[u8]],
            ) -> Result<Vec<$crate::store::Claim>, $crate::store::StoreError> {
                self.$to
                    .claim_completed_batch(conn, scope, times, reqs, results)
                    .await
            }

            async fn complete(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                key: &str,
                result: &[u8],
            ) -> Result<(), $crate::store::StoreError> {
                self.$to.complete(conn, scope, key, result).await
            }

            async fn complete_many(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                results: &[(&str, &[u8])],
            ) -> Result<(), $crate::store::StoreError> {
                self.$to.complete_many(conn, scope, results).await
            }

            async fn get(
                &self,
                scope: &str,
                key: &str,
            ) -> Result<Option<$crate::store::Record>, $crate::store::StoreError> {
                self.$to.get(scope, key).await
            }

            async fn bump_attempts(
                &self,
                scope: &str,
                key: &str,
                times: $crate::store::ClaimTimes,
            ) -> Result<u32, $crate::store::StoreError> {
                self.$to.bump_attempts(scope, key, times).await
            }

            async fn undo_attempt(
                &self,
                scope: &str,
                key: &str,
            ) -> Result<(), $crate::store::StoreError> {
                self.$to.undo_attempt(scope, key).await
            }

            async fn clear_attempts(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                key: &str,
            ) -> Result<(), $crate::store::StoreError> {
                self.$to.clear_attempts(conn, scope, key).await
            }

            async fn purge_expired(
                &self,
                scope: Option<&str>,
                now_ms: i64,
                limit: u32,
            ) -> Result<u64, $crate::store::StoreError> {
                self.$to.purge_expired(scope, now_ms, limit).await
            }

            async fn advance_fence(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                entity: &str,
                order: &[u8],
                expires_at_ms: i64,
                now_ms: i64,
            ) -> Result<Vec<u8>, $crate::store::StoreError> {
                self.$to
                    .advance_fence(conn, scope, entity, order, expires_at_ms, now_ms)
                    .await
            }

            async fn fence(
                &self,
                scope: &str,
                entity: &str,
            ) -> Result<Option<$crate::store::FenceRecord>, $crate::store::StoreError> {
                self.$to.fence(scope, entity).await
            }

            fn records_steps(&self) -> bool {
                self.$to.records_steps()
            }

            async fn step(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                key: &str,
                step: &str,
                now_ms: i64,
            ) -> Result<Option<$crate::store::StepRecord>, $crate::store::StoreError> {
                self.$to.step(conn, scope, key, step, now_ms).await
            }

            async fn record_step(
                &self,
                scope: &str,
                key: &str,
                step: &str,
                fingerprint: Option<&[u8]>,
                result: &[u8],
                times: $crate::store::ClaimTimes,
            ) -> Result<$crate::store::StepRecord, $crate::store::StoreError> {
                self.$to
                    .record_step(scope, key, step, fingerprint, result, times)
                    .await
            }

            async fn steps(
                &self,
                scope: &str,
                key: &str,
            ) -> Result<Vec<$crate::store::StepRecord>, $crate::store::StoreError> {
                self.$to.steps(scope, key).await
            }

            async fn orphaned_steps(
                &self,
                created_before_ms: i64,
                now_ms: i64,
                limit: u32,
            ) -> Result<Vec<$crate::store::OrphanedStep>, $crate::store::StoreError> {
                self.$to
                    .orphaned_steps(created_before_ms, now_ms, limit)
                    .await
            }

            async fn rotations(
                &self,
                now_ms: i64,
            ) -> Result<Option<$crate::store::Rotations>, $crate::store::StoreError> {
                self.$to.rotations(now_ms).await
            }

            $($extra)*
        }
    };
}

/// Implements [`AdminStore`](crate::store::admin::AdminStore) for `$store`
/// by forwarding every query to its field `$to`.
///
/// `forward_admin_store!(impl[<generics>] for Store => field)`
macro_rules! forward_admin_store {
    ($(#[$attr:meta])* impl[$($gen:tt)*] for $store:ty => $to:ident) => {
        $(#[$attr])*
        #[async_trait::async_trait]
        impl<$($gen)*> $crate::store::admin::AdminStore for $store {
            async fn check_columns(&self) -> Result<(), $crate::store::StoreError> {
                self.$to.check_columns().await
            }

            async fn stats(
                &self,
                scope: Option<&str>,
                now_ms: i64,
            ) -> Result<Vec<$crate::store::admin::ScopeStats>, $crate::store::StoreError> {
                self.$to.stats(scope, now_ms).await
            }

            async fn find(
                &self,
                filter: &$crate::store::admin::RecordFilter,
            ) -> Result<Vec<$crate::store::Record>, $crate::store::StoreError> {
                self.$to.find(filter).await
            }

            async fn count(
                &self,
                scope: Option<&str>,
                which: $crate::store::admin::CountFilter,
            ) -> Result<u64, $crate::store::StoreError> {
                self.$to.count(scope, which).await
            }

            async fn purge_created_before(
                &self,
                scope: Option<&str>,
                cutoff_ms: i64,
                after: Option<&$crate::store::admin::PurgeCursor>,
                batch: u32,
            ) -> Result<$crate::store::admin::PurgeStep, $crate::store::StoreError> {
                self.$to
                    .purge_created_before(scope, cutoff_ms, after, batch)
                    .await
            }
        }
    };
}

pub(crate) use {forward_admin_store, forward_sql_store};
