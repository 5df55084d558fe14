//! PostgreSQL store (feature `postgres`).
//!
//! Claims use `INSERT ... ON CONFLICT DO NOTHING`: a caught unique
//! violation would abort the whole Postgres transaction, `ON CONFLICT` does
//! not. A concurrent claim of the same key blocks on the winner's uncommitted
//! row, then sees its committed record (or inserts, if the winner rolled
//! back). Transactions run at the database's default isolation, normally
//! READ COMMITTED; under REPEATABLE READ or SERIALIZABLE a losing claim gets a
//! serialization failure, which is transient and retried by the engine.
//! Batch claims insert all keys in one `UNNEST` statement.
//!
//! # A silent network
//!
//! Every call is bounded on the client side ([`Deadlines`]). On the server
//! side, the sessions of [`PgStore::connect`] and
//! [`PgStore::connect_with`] set `idle_in_transaction_session_timeout`
//! (15 s) and `tcp_keepalives_idle`/`interval`/`count` (10 s, 5 s, 3) in
//! their startup options ([`PgStore::session_options`]), so that a client
//! whose network went silent does not keep its transaction, and the claim
//! locks in it, for hours; and [`migrate`](crate::SqlStore::migrate)
//! waits for locks at most 10 s (`SET LOCAL lock_timeout`). For a pool of
//! your own, pass your connect options through
//! [`PgStore::session_options`] and build the pool on
//! [`pool_options_for`](crate::store::pool_options_for). A store that
//! connected itself also starts its sessions with the claims'
//! `lock_timeout` (10 s), so a claim's `BEGIN` sets nothing. Behind
//! PgBouncer, add `options` to its `ignore_startup_parameters` and set
//! the settings on the role instead (`ALTER ROLE ... SET
//! idle_in_transaction_session_timeout = '15s'`, and `lock_timeout =
//! '10s'`, which the connected store's claims then rely on), or build the
//! store on a pool of your own ([`PgStore::new`]), whose claims set
//! `lock_timeout` on `BEGIN`.

mod generations;
mod pipelined;
pub(crate) use generations::DEFAULT_ROTATION_STEP;
pub(crate) use generations::{adopt_plain_table, partitions_ddl, rows_sql, switch_sql};
mod unnest;

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

use sqlx::QueryBuilder;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgQueryResult, Postgres};
use sqlx::query::Query;

use super::backend::Backend;
use super::base::SqlBase;
use super::claim::Existing;
use super::deadline::within;
use super::dialect::{Dialect, Layout};
use super::sql::{Sql, lock_timeout_value};
use super::{Claim, ClaimRequest, ClaimTimes, Deadlines, StoreError, TableName};

/// A dedup store in PostgreSQL.
#[derive(Clone, Debug)]
pub struct PgStore {
    base: SqlBase<Postgres>,
    /// The claim transactions' `lock_timeout` (`None`: the server's).
    lock_timeout: Option<Duration>,
    /// The `lock_timeout` the pool's sessions start with, when this store
    /// built the pool ([`PgStore::connect_with_deadlines`] sets it in the
    /// startup options): while it is [`lock_timeout`](Self::lock_timeout),
    /// a claim's `BEGIN` needs no `SET LOCAL`, one statement less per
    /// delivery. `None`: unknown (a pool of the caller's).
    session_lock_timeout: Option<Duration>,
    /// Whether claims travel with `BEGIN` and results with `COMMIT`.
    pipelined: bool,
    /// How many buckets each generation's migration creates (the table's
    /// [`Layout`] is `base.layout`; this is kept while it is plain).
    buckets: u16,
    /// How many bytes a rotation frees per fenced step, at most.
    rotation_step: u64,
}

pub use crate::store::{DEFAULT_GENERATION_BUCKETS, MAX_GENERATION_BUCKETS};

/// `buckets` within 1 ..= [`MAX_GENERATION_BUCKETS`].
fn bucket_count(buckets: u16) -> u16 {
    buckets.clamp(1, MAX_GENERATION_BUCKETS)
}

/// The default [`PgStore::lock_timeout`]: 10 s.
pub(crate) const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// `BEGIN` with a transaction-local `lock_timeout` if `set` asks for one
/// (`Some(None)`: no limit), and the rotation fence of the generations
/// layout, in one round trip.
fn begin_sql(set: Option<Option<Duration>>, fence: Option<String>) -> Cow<'static, str> {
    let begin = match set {
        None => Cow::Borrowed(Postgres::BEGIN),
        Some(bound) => Cow::Owned(format!("BEGIN; {}", set_local_lock_timeout(bound))),
    };
    match fence {
        None => begin,
        Some(fence) => Cow::Owned(format!("{begin}; {fence}")),
    }
}

/// `SET LOCAL lock_timeout` to a claim transaction's `bound` (`None`:
/// no limit).
fn set_local_lock_timeout(bound: Option<Duration>) -> String {
    match bound {
        Some(t) => format!("SET LOCAL lock_timeout = '{}'", lock_timeout_value(t)),
        None => "SET LOCAL lock_timeout = 0".to_owned(),
    }
}

impl PgStore {
    /// A store over `pool`, using the default table `onceonly_keys`.
    /// Build the pool on [`pool_options_for`](crate::store::pool_options_for)
    /// and its connect options with [`PgStore::session_options`], as
    /// [`PgStore::connect_with`] does, so that connections of a silent
    /// network are discarded and the server bounds a silent session.
    pub fn new(pool: PgPool) -> Self {
        Self {
            base: SqlBase::new(pool, TableName::default()),
            lock_timeout: Some(DEFAULT_LOCK_TIMEOUT),
            session_lock_timeout: None,
            pipelined: false,
            buckets: DEFAULT_GENERATION_BUCKETS,
            rotation_step: DEFAULT_ROTATION_STEP,
        }
        .layout()
    }

    /// Rebuilds the statements and the claim transactions' `BEGIN` from
    /// the table and its layout (`SqlBase::with_layout`, as every store
    /// does), generations or not as the table is now, with this store's
    /// buckets; then adds this store's own settings: the rotation step and
    /// the lock timeout.
    fn layout(self) -> Self {
        let generations = self.base.layout.is_generations();
        self.with_generations(generations)
    }

    /// [`layout`](Self::layout) with the generations layout or not.
    fn with_generations(mut self, generations: bool) -> Self {
        let layout = if generations {
            Layout::Generations {
                buckets: self.buckets,
            }
        } else {
            Layout::Plain
        };
        self.base = self.base.with_layout(layout);
        // Freshly built: this store holds the only reference.
        if let Some(rotation) =
            std::sync::Arc::get_mut(&mut self.base.sql).and_then(|sql| sql.rotation.as_mut())
        {
            rotation.free_per_step = self.rotation_step;
        }
        let fence = layout
            .is_generations()
            .then(|| generations::fence_shared(&self.base.table));
        self.base.begin = begin_sql(self.lock_timeout_to_set(), fence);
        self
    }

    /// The `lock_timeout` a claim transaction sets for itself: `None` when
    /// its session starts with the store's already, `Some(None)` for no
    /// limit.
    fn lock_timeout_to_set(&self) -> Option<Option<Duration>> {
        match (self.lock_timeout, self.session_lock_timeout) {
            (Some(wanted), Some(session)) if wanted == session => None,
            (None, None) => None,
            (wanted, _) => Some(wanted),
        }
    }

    /// Connects to `url` with a default pool (10 connections, built on
    /// [`pool_options`](crate::store::pool_options), so connections stuck
    /// read-only after a failover or silent on a dead network are
    /// recycled) and the default [`Deadlines`], set on the server too
    /// ([`PgStore::session_options`]).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url.parse()?).await
    }

    /// Connects with `options` (TLS settings, a password from a secret
    /// store, ...) with the same pool as [`PgStore::connect`].
    pub async fn connect_with(options: PgConnectOptions) -> Result<Self, StoreError> {
        Self::connect_with_deadlines(options, Deadlines::default()).await
    }

    /// Connects with `options` like [`PgStore::connect_with`], under
    /// `deadlines` instead of the defaults: the pool's acquire timeout,
    /// the server-side settings of its sessions and the bounds of every
    /// call.
    pub async fn connect_with_deadlines(
        options: PgConnectOptions,
        deadlines: Deadlines,
    ) -> Result<Self, StoreError> {
        let options = Self::session_options(options, &deadlines)
            .options([("lock_timeout", DEFAULT_LOCK_TIMEOUT.as_millis().to_string())]);
        let pool = crate::store::pool_options_for(&deadlines)
            .max_connections(10)
            .connect_with(options)
            .await?;
        let store = Self {
            session_lock_timeout: Some(DEFAULT_LOCK_TIMEOUT),
            ..Self::new(pool)
        };
        Ok(store.layout().deadlines(deadlines))
    }

    /// `options` with the server-side bounds of `deadlines` in its startup
    /// options: `idle_in_transaction_session_timeout` (a session idle
    /// inside a transaction, e.g. of a client whose network went silent,
    /// is ended and its locks released) and `tcp_keepalives_idle`,
    /// `tcp_keepalives_interval`, `tcp_keepalives_count`. For pools of your
    /// own:
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), sqlx::Error> {
    /// use onceonly::PgStore;
    /// use onceonly::store::{Deadlines, pool_options_for};
    ///
    /// let deadlines = Deadlines::default();
    /// let options = PgStore::session_options("postgres://app@db/app".parse()?, &deadlines);
    /// let pool = pool_options_for(&deadlines).max_connections(20).connect_with(options).await?;
    /// let store = PgStore::new(pool).deadlines(deadlines);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn session_options(options: PgConnectOptions, deadlines: &Deadlines) -> PgConnectOptions {
        let mut settings: Vec<(&str, String)> = Vec::new();
        if let Some(idle) = deadlines.idle_in_transaction_timeout() {
            let ms = idle.as_millis().clamp(1, i32::MAX as u128);
            settings.push(("idle_in_transaction_session_timeout", ms.to_string()));
        }
        if let Some(k) = deadlines.tcp_keepalive_settings() {
            let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64).to_string();
            settings.push(("tcp_keepalives_idle", secs(k.idle)));
            settings.push(("tcp_keepalives_interval", secs(k.interval)));
            settings.push(("tcp_keepalives_count", k.count.max(1).to_string()));
        }
        if settings.is_empty() {
            return options;
        }
        options.options(settings)
    }

    /// Bounds every call of this store, and the transactions an engine
    /// runs on it, by `deadlines` (default [`Deadlines::default`]). The
    /// pool and server settings are those it was connected with (see
    /// [`PgStore::connect_with_deadlines`]).
    #[must_use]
    pub fn deadlines(mut self, deadlines: Deadlines) -> Self {
        self.base.deadlines = deadlines;
        self
    }

    /// How long a statement of a claim transaction (the claim, and the
    /// handler's statements in it) waits for a row lock before it fails
    /// with `55P03` (default 10 s; `None`: the server's
    /// setting, by default no limit). A claim stuck behind a transaction
    /// that never ends would otherwise hold its partition or queue slot
    /// forever; a lock timeout is contention, and the delivery waits in
    /// place and tries again. A store that connected itself
    /// ([`PgStore::connect`] and its kin) starts its sessions with the
    /// default, so its claims set nothing; another value (or a pool of
    /// your own) is set on `BEGIN`, in the same round trip. Statements on
    /// the connected store's pool outside a claim wait as long. A handler
    /// that changes `lock_timeout` for its session (`SET` without `LOCAL`)
    /// changes it for the later claims on that connection too: use
    /// `SET LOCAL`.
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.lock_timeout = timeout;
        self.layout()
    }

    /// Whether a claim travels with its transaction's `BEGIN` and the
    /// result with its `COMMIT` (default `false`): a claimed delivery then
    /// costs two round trips less, the round trips of the same work
    /// without dedup. Each end is one simple-query message of several
    /// statements whose values travel hex-encoded, so the server parses
    /// and plans them every time instead of reusing prepared statements.
    /// Choose it when the round trip, not the database's CPU, is what a
    /// delivery waits on: a database a network away from the consumer
    /// (0.5 ms and more per round trip) with few deliveries in flight. On
    /// a database next to the consumer and busy, it costs more than it
    /// saves (see BENCHMARKS.md). Batches
    /// ([`Engine::process_batch`](crate::Engine::process_batch)) always
    /// run as statements of their own.
    #[must_use]
    pub fn pipelined(mut self, pipelined: bool) -> Self {
        self.pipelined = pipelined;
        self
    }

    /// Uses table `name` (`table` or `schema.table`), validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self {
            base: self.base.on_table(TableName::new(name)?),
            ..self
        }
        .layout())
    }

    /// Whether the dedup table has the *generations* layout (default
    /// `false`): two partitions, purged by `TRUNCATE` of the older one
    /// instead of by `DELETE`, so a purge never competes with claims,
    /// however big the table (see
    /// [the guide](crate::store#a-dedup-table-of-100-million-records-the-generations-layout-postgresql)).
    /// [`migrate`](crate::SqlStore::migrate) then creates
    /// that layout, or upgrades a plain table to it (run
    /// [`prepare_generations`](Self::prepare_generations) first on a big
    /// one); [`purge_expired`](crate::SqlStore::purge_expired) of the whole
    /// table rotates the generations. Every process on the table must use
    /// the same layout: the plain statements fail on a generations table
    /// (and its migration refuses it), and the other way round.
    ///
    /// On this layout a claim also probes the other generation (one index
    /// look-up more in the same statement), its transaction takes a shared
    /// advisory lock with its `BEGIN`, and [`pipelined`](Self::pipelined)
    /// is ignored.
    #[must_use]
    pub fn generations(self, generations: bool) -> Self {
        self.with_generations(generations)
    }

    /// Into how many hash partitions on `idem_key` ("buckets", 1 to
    /// [`MAX_GENERATION_BUCKETS`];
    /// default [`DEFAULT_GENERATION_BUCKETS`]) [`migrate`](crate::SqlStore::migrate)
    /// splits each generation of the [`generations`](Self::generations)
    /// layout; 1 keeps each generation one table. Only the migration that
    /// creates a generation reads this; rotations find the buckets a table
    /// has.
    ///
    /// Buckets let a rotation free a big generation's files a piece at a
    /// time: it truncates at most [`rotation_step`](Self::rotation_step)
    /// of buckets per fenced transaction and pauses twenty times as long as
    /// that commit took before the next one. PostgreSQL
    /// unlinks a truncated relation's files as the transaction commits, and
    /// on many file systems (ext4 mounted with `discard`, thin-provisioned
    /// cloud disks) freeing 8 GB at once stalls every `fsync` for seconds,
    /// the commits of claims included. Split into 8 buckets, a rotation at
    /// 100 million records frees about 1 GB at a time; up to about 10
    /// million records it frees the generation in one step anyway. What it
    /// costs: each statement on the table locks every bucket (PostgreSQL
    /// locks all partitions of a cached plan before pruning them); see
    /// BENCHMARKS.md.
    ///
    /// A table upgraded from the plain layout keeps its old table as
    /// generation 0 until its first rotation, which truncates it whole and
    /// splits it like generation 1.
    #[must_use]
    pub fn generation_buckets(mut self, buckets: u16) -> Self {
        self.buckets = bucket_count(buckets);
        self.layout()
    }

    /// How many bytes of files (tables and indexes) a rotation of the
    /// [`generations`](Self::generations) layout frees per fenced step, at
    /// most (default 1 GiB; at least 1): it
    /// truncates as many buckets of the other generation as fit, pauses
    /// twenty times as long as that commit took, and so on; the last step's
    /// worth goes with the switch. A generation smaller than one step is
    /// rotated in one transaction; a bucket bigger than a step is a step of
    /// its own. Smaller steps make shorter `fsync` stalls, more of them.
    #[must_use]
    pub fn rotation_step(mut self, bytes: u64) -> Self {
        self.rotation_step = bytes.max(1);
        self.layout()
    }

    /// Whether this store uses the generations layout
    /// ([`PgStore::generations`]).
    pub fn has_generations(&self) -> bool {
        self.base.layout.is_generations()
    }

    /// The layout of the table, as this store's settings say
    /// ([`generations`](Self::generations),
    /// [`generation_buckets`](Self::generation_buckets)).
    pub fn layout_of_table(&self) -> Layout {
        self.base.layout
    }

    /// The store with the layout its table has: the generations layout if
    /// the table is partitioned, the plain one otherwise (also when the
    /// table does not exist yet). For tools that open any table, like the
    /// `onceonly` CLI.
    pub async fn detect_layout(self) -> Result<Self, StoreError> {
        let found = within(
            self.base.pool_bound(),
            "layout",
            generations::detect(&self.base),
        )
        .await?;
        Ok(self.generations(found))
    }

    /// Prepares a plain dedup table for its upgrade to the generations
    /// layout while claims go on: adds the `generation` column (0 for
    /// every record; instant), a validated `CHECK (generation = 0)` and a
    /// unique index on `(scope, idem_key, generation)` built
    /// `CONCURRENTLY`. The upgrade itself ([`migrate`](crate::SqlStore::migrate)
    /// on a store with [`generations`](Self::generations)) then only
    /// renames and attaches, in milliseconds, instead of scanning the table
    /// and building the index under an exclusive lock. Plain-layout
    /// processes keep working on a prepared table. Takes as long as the
    /// index build (minutes at 100 million rows) and is not bounded by the
    /// store's deadlines: the build waits up to 15 minutes for the
    /// transactions older than it (in the whole database) to end, the other
    /// steps for locks as long as a migration. A run that was interrupted
    /// can simply be run again. Does nothing on a table that already has
    /// the layout.
    pub async fn prepare_generations(&self) -> Result<(), StoreError> {
        generations::prepare(&self.base).await
    }
}

super::forward::forward_sql_store!(
    impl[] for PgStore => base, Db = Postgres,
    async fn open_claim(
        &self,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Result<super::ClaimTx<Postgres>, Claim>, StoreError> {
        if self.pipelined && !self.has_generations() {
            self.open_pipelined(scope, times, req).await
        } else {
            super::open_by_statements(self, scope, times, req).await
        }
    },
    async fn finish_claim(
        &self,
        tx: super::ClaimTx<Postgres>,
        scope: &str,
        key: &str,
        result: &[u8],
        clear_attempts: bool,
    ) -> Result<(), StoreError> {
        self.finish_pipelined(tx, scope, key, result, clear_attempts).await
    },
);
super::forward::forward_admin_store!(impl[] for PgStore => base);

impl Backend for Postgres {
    const DIALECT: Dialect = Dialect::Postgres;
    const ROW_VALUES: bool = true;
    const BEGIN: &'static str = "BEGIN";
    const MIGRATE_BEGIN: Option<&'static str> = Some("BEGIN");

    /// Also quiet: every `CREATE ... IF NOT EXISTS` that finds its object
    /// would send a NOTICE ("relation ... already exists, skipping"),
    /// which sqlx logs at INFO, on every start.
    fn migration_lock_sql(timeout: Duration) -> Option<String> {
        Some(format!(
            "SELECT set_config('lock_timeout', '{}', true), \
             set_config('client_min_messages', 'warning', true)",
            lock_timeout_value(timeout)
        ))
    }

    fn sql(table: &TableName, layout: Layout) -> Sql {
        match layout {
            Layout::Plain => Sql::postgres(table),
            Layout::Generations { buckets } => generations::sql(table, bucket_count(buckets)),
        }
    }

    /// On the generations layout, with the shared rotation fence.
    fn begin(table: &TableName, layout: Layout) -> std::borrow::Cow<'static, str> {
        let fence = layout
            .is_generations()
            .then(|| generations::fence_shared(table));
        begin_sql(None, fence)
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn build<'q>(qb: &'q mut QueryBuilder<'_, Self>) -> Query<'q, Self, Self::Arguments<'q>> {
        qb.build()
    }

    async fn claim_batch(
        base: &SqlBase<Self>,
        conn: &mut PgConnection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Option<Result<Vec<Claim>, StoreError>> {
        Some(unnest::claim_batch(base, conn, scope, times, reqs).await)
    }

    async fn existing_many(
        base: &SqlBase<Self>,
        conn: &mut PgConnection,
        scope: &str,
        keys: &[&str],
    ) -> Option<Result<HashMap<String, Existing>, StoreError>> {
        Some(unnest::existing_many(base, conn, scope, keys).await)
    }

    async fn claim_completed_batch(
        base: &SqlBase<Self>,
        conn: &mut PgConnection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
        results: &[&[u8]],
    ) -> Option<Result<Vec<Claim>, StoreError>> {
        Some(unnest::claim_completed_batch(base, conn, scope, times, reqs, results).await)
    }

    async fn complete_many(
        base: &SqlBase<Self>,
        conn: &mut PgConnection,
        scope: &str,
        results: &[(&str, &[u8])],
    ) -> Option<Result<(), StoreError>> {
        Some(unnest::complete_many(base, conn, scope, results).await)
    }

    async fn rotate(base: &SqlBase<Self>, now_ms: i64) -> Option<Result<u64, StoreError>> {
        let rotation = base.sql.rotation.as_ref()?;
        Some(generations::rotate(base, rotation, now_ms).await)
    }

    async fn rotations(
        base: &SqlBase<Self>,
        now_ms: i64,
    ) -> Option<Result<super::Rotations, StoreError>> {
        let rotation = base.sql.rotation.as_ref()?;
        Some(generations::rotations(base, rotation, now_ms).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lazy_pool() -> PgPool {
        sqlx::postgres::PgPoolOptions::new().connect_lazy_with(PgConnectOptions::new())
    }

    /// Each statement of a migration runs once: the plain layout built
    /// the fence and steps tables' DDL twice (`pg_side_ddl`, then
    /// `with_side`), and each second `CREATE ... IF NOT EXISTS` logged
    /// "relation ... already exists, skipping" on every start.
    #[test]
    fn a_migration_runs_each_statement_once() {
        let table = TableName::default();
        for layout in [Layout::Plain, Layout::Generations { buckets: 3 }] {
            let ddl = Postgres::sql(&table, layout).ddl;
            let mut seen = std::collections::HashSet::new();
            for statement in &ddl {
                assert!(seen.insert(statement), "{layout:?} runs twice: {statement}");
            }
            for side in ["_fence", "_steps", "_attempts"] {
                assert!(
                    ddl.iter().any(|s| s.contains(&format!("{table}{side}"))),
                    "{layout:?} creates {table}{side}"
                );
            }
        }
    }

    /// A claim's `BEGIN` sets `lock_timeout` only where its session does
    /// not start with the store's: a store that built its pool (and set
    /// the bound in the sessions' startup options) begins with a plain
    /// `BEGIN`, one statement less per delivery; a pool of the caller's,
    /// another bound, or none, still set theirs.
    #[tokio::test]
    async fn begin_sets_the_lock_timeout_only_where_the_session_lacks_it() {
        let connected = PgStore {
            session_lock_timeout: Some(DEFAULT_LOCK_TIMEOUT),
            ..PgStore::new(lazy_pool())
        }
        .layout();
        assert_eq!(connected.base.begin, "BEGIN");
        let own_pool = PgStore::new(lazy_pool());
        assert_eq!(
            own_pool.base.begin,
            "BEGIN; SET LOCAL lock_timeout = '10000ms'"
        );
        let other = connected.clone().lock_timeout(Some(Duration::from_secs(3)));
        assert_eq!(other.base.begin, "BEGIN; SET LOCAL lock_timeout = '3000ms'");
        let unbounded = connected.clone().lock_timeout(None);
        assert_eq!(unbounded.base.begin, "BEGIN; SET LOCAL lock_timeout = 0");
        assert_eq!(
            PgStore::new(lazy_pool()).lock_timeout(None).base.begin,
            "BEGIN"
        );
        // The pipelined claim alike.
        let req = ClaimRequest {
            key: "k",
            fingerprint: None,
            source: None,
            lock_wait: None,
        };
        let times = ClaimTimes::new(0, Duration::from_secs(1));
        let (sql, insert_at) = pipelined::open_sql(&connected, "s", times, &req);
        assert!(!sql.contains("lock_timeout"), "{sql}");
        assert_eq!(insert_at, 1);
        let (sql, insert_at) = pipelined::open_sql(&own_pool, "s", times, &req);
        assert!(sql.contains("SET LOCAL lock_timeout = '10000ms'"), "{sql}");
        assert_eq!(insert_at, 2);
    }

    /// Statements come from the table and its layout together: moving a
    /// store of the generations layout to another table cannot leave it
    /// with the plain statements, nor with the old table's fence.
    #[tokio::test]
    async fn a_store_moved_to_another_table_keeps_its_layout() {
        let other = TableName::new("other_keys").unwrap();
        let layout = Layout::Generations { buckets: 4 };
        let expected = Postgres::sql(&other, layout);

        let base = SqlBase::<Postgres>::new(lazy_pool(), TableName::default())
            .with_layout(layout)
            .on_table(other.clone());
        assert_eq!(base.layout, layout);
        assert_eq!(base.sql.insert, expected.insert);
        assert_eq!(base.sql.ddl, expected.ddl);
        assert_ne!(base.sql.insert, Sql::postgres(&other).insert);
        assert!(base.begin.contains(&generations::fence_shared(&other)));

        let store = PgStore::new(lazy_pool())
            .generations(true)
            .generation_buckets(4)
            .with_table("other_keys")
            .unwrap();
        assert_eq!(store.layout_of_table(), layout);
        assert_eq!(store.base.sql.insert, expected.insert);
        assert!(
            store
                .base
                .begin
                .contains(&generations::fence_shared(&other))
        );
        assert!(store.base.begin.contains("lock_timeout"));
    }

    #[test]
    fn migration_sql_is_the_stores_ddl_without_the_lock() {
        let table = TableName::default();
        for layout in [Layout::Plain, Layout::Generations { buckets: 3 }] {
            let ddl = crate::ops::admin::migration_sql(Dialect::Postgres, layout, &table).unwrap();
            let store = crate::store::without_migration_lock(Postgres::sql(&table, layout).ddl);
            assert_eq!(ddl, store);
        }
        assert_eq!(
            crate::ops::admin::migration_sql(
                Dialect::Postgres,
                Layout::Generations { buckets: 0 },
                &table
            ),
            crate::ops::admin::migration_sql(
                Dialect::Postgres,
                Layout::Generations { buckets: 1 },
                &table
            ),
            "buckets are clamped to 1 ..= MAX_GENERATION_BUCKETS"
        );
    }
}
