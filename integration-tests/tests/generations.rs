//! PostgreSQL's generations layout (`PgStore::generations`): a purge
//! rotates two partitions and truncates the older one, only once none of
//! its records is live; keys stay deduplicated across rotations, also for a
//! claim in flight while a rotation runs (the fence); a plain table is
//! upgraded in place, prepared online first; the CLI finds the layout by
//! itself. Each generation is split into hash buckets that a rotation
//! empties one transaction at a time, resuming where a failed rotation
//! stopped.
//!
//! Requires PostgreSQL (`ONCEONLY_PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `scripts/services` starts it).

use std::time::Duration;

use onceonly::store::raw::{Claim, ClaimRequest, ClaimTimes};
use onceonly::{PgStore, SqlStore};
use onceonly_integration_tests::cli::onceonly;
use onceonly_integration_tests::{pg_generations_store, pg_store, pg_url, unique};
use sqlx::PgPool;

const SCOPE: &str = "payments";

async fn generations_store(table: &str) -> PgStore {
    pg_generations_store(&pg_url(), table).await
}

/// Claims `key` at `now_ms` for `ttl`, commits it with a result if claimed.
async fn claim(store: &PgStore, key: &str, now_ms: i64, ttl: Duration) -> Claim {
    let mut tx = store.begin().await.expect("begin");
    let times = ClaimTimes::new(now_ms, ttl);
    let claim = store
        .claim(&mut tx, SCOPE, times, &ClaimRequest::new(key))
        .await
        .expect("claim");
    if claim == Claim::Claimed {
        store
            .complete(&mut tx, SCOPE, key, b"\"ok\"")
            .await
            .expect("complete");
        tx.commit().await.expect("commit");
    }
    claim
}

fn is_duplicate(claim: &Claim) -> bool {
    matches!(claim, Claim::Duplicate { .. })
}

/// Records per generation, `[g0, g1]`.
async fn per_generation(pool: &PgPool, table: &str) -> [i64; 2] {
    let mut counts = [0; 2];
    for (g, count) in counts.iter_mut().enumerate() {
        *count = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}_g{g}"))
            .fetch_one(pool)
            .await
            .expect("count a generation");
    }
    counts
}

async fn current(pool: &PgPool, table: &str) -> i16 {
    sqlx::query_scalar(&format!("SELECT current FROM {table}_generation"))
        .fetch_one(pool)
        .await
        .expect("current generation")
}

async fn drop_layout(pool: &PgPool, table: &str) {
    for t in [
        table.to_owned(),
        format!("{table}_generation"),
        format!("{table}_attempts"),
        format!("{table}_g0"),
    ] {
        sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(pool)
            .await
            .ok();
    }
}

#[tokio::test]
async fn a_rotation_truncates_only_a_generation_with_no_live_record() {
    let table = unique("gen_keys");
    let store = generations_store(&table).await;
    let pool = store.pool().clone();
    let ttl = Duration::from_millis(1_000);

    // Generation 0 is current: A lives until 2000.
    assert_eq!(claim(&store, "A", 1_000, ttl).await, Claim::Claimed);
    // The other generation is empty: the first purge rotates at once and
    // truncates nothing; A stays, and stays a duplicate.
    assert_eq!(store.purge_expired(None, 1_500, 5_000).await.unwrap(), 0);
    assert_eq!(current(&pool, &table).await, 1);
    assert!(is_duplicate(&claim(&store, "A", 1_600, ttl).await));
    // B lands in generation 1; A (generation 0) is live until 2000, so
    // no rotation before then.
    assert_eq!(
        claim(&store, "B", 1_700, Duration::from_secs(10)).await,
        Claim::Claimed
    );
    assert_eq!(store.purge_expired(None, 1_999, 5_000).await.unwrap(), 0);
    assert_eq!(current(&pool, &table).await, 1);
    assert_eq!(per_generation(&pool, &table).await, [1, 1]);

    // At 2500 A has expired: generation 0 is truncated and current again.
    store.purge_expired(None, 2_500, 5_000).await.unwrap();
    assert_eq!(current(&pool, &table).await, 0);
    assert_eq!(per_generation(&pool, &table).await, [0, 1]);
    // B (generation 1, live) is still a duplicate; A is new again.
    assert!(is_duplicate(&claim(&store, "B", 2_600, ttl).await));
    assert_eq!(claim(&store, "A", 2_600, ttl).await, Claim::Claimed);
    // B keeps generation 1 from being truncated.
    assert_eq!(store.purge_expired(None, 3_000, 5_000).await.unwrap(), 0);
    assert_eq!(per_generation(&pool, &table).await, [1, 1]);

    // An expired record in the current generation is reclaimed in place.
    assert_eq!(claim(&store, "A", 4_000, ttl).await, Claim::Claimed);
    assert_eq!(per_generation(&pool, &table).await, [1, 1]);
    // No row was ever deleted: truncates only, nothing for vacuum.
    let deleted: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(n_tup_del), 0)::bigint FROM pg_stat_user_tables WHERE relname LIKE $1",
    )
    .bind(format!("{table}_g%"))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(deleted, 0, "a rotation deletes no row one by one");

    // A scoped purge still deletes (bounded) expired records.
    assert_eq!(
        store
            .purge_expired(Some(SCOPE), 20_000, 5_000)
            .await
            .unwrap(),
        2
    );
    drop_layout(&pool, &table).await;
}

/// A key can have a record in each generation: an expired one in the
/// other generation and a live one in the current. A purge of one scope
/// deletes the expired record only: deleting the live one with it would
/// let the next duplicate of the key run its handler again.
#[tokio::test]
async fn a_scoped_purge_keeps_the_live_record_of_a_key_expired_in_the_other_generation() {
    let table = unique("gen_keys");
    let store = generations_store(&table).await;
    let pool = store.pool().clone();

    // K in generation 0, live until 1100.
    assert_eq!(
        claim(&store, "K", 1_000, Duration::from_millis(100)).await,
        Claim::Claimed
    );
    // The first purge rotates at once: generation 1 is current.
    store.purge_expired(None, 1_050, 5_000).await.unwrap();
    assert_eq!(current(&pool, &table).await, 1);
    // K's record expired at 1100: a redelivery claims K again, in
    // generation 1, live until 11_200.
    assert_eq!(
        claim(&store, "K", 1_200, Duration::from_secs(10)).await,
        Claim::Claimed
    );
    assert_eq!(per_generation(&pool, &table).await, [1, 1]);

    // A purge of the scope deletes K's expired record, not its live one.
    assert_eq!(
        store
            .purge_expired(Some(SCOPE), 2_000, 5_000)
            .await
            .unwrap(),
        1
    );
    assert_eq!(per_generation(&pool, &table).await, [0, 1]);
    // So the next copy of K inside its retention is a duplicate.
    assert!(
        is_duplicate(&claim(&store, "K", 2_100, Duration::from_secs(10)).await),
        "K's live record survived the scoped purge"
    );
    // Once it expired, the scope's purge deletes it too.
    assert_eq!(
        store
            .purge_expired(Some(SCOPE), 20_000, 5_000)
            .await
            .unwrap(),
        1
    );
    assert_eq!(per_generation(&pool, &table).await, [0, 0]);
    drop_layout(&pool, &table).await;
}

/// The buckets of generation `g` (name, heap bytes), by name.
async fn buckets(pool: &PgPool, table: &str, g: usize) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(c.oid) FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1) \
         ORDER BY c.relname",
    )
    .bind(format!("{table}_g{g}"))
    .fetch_all(pool)
    .await
    .expect("buckets of a generation")
}

/// A generation is split into 8 hash buckets (the default), and a rotation
/// empties them a step (`rotation_step`) at a time, one transaction each,
/// before it switches: a bucket it
/// cannot truncate (a long report holds it) stops the rotation there, as
/// contention, with the buckets before it empty, the rest untouched, the
/// current generation unchanged and every live key still a duplicate. The
/// next purge goes on from where it stopped.
#[tokio::test]
async fn a_rotation_empties_buckets_one_at_a_time_and_resumes_where_it_stopped() {
    let table = unique("gen_buckets");
    // Steps of one byte: one bucket per step (at 1 GiB, the default, a
    // generation this small goes in one step).
    let store = generations_store(&table).await.rotation_step(1);
    let pool = store.pool().clone();
    assert_eq!(buckets(&pool, &table, 0).await.len(), 8);
    assert_eq!(buckets(&pool, &table, 1).await.len(), 8);

    // 400 keys in generation 0, expiring at 2000; rotate to generation 1.
    for i in 0..400 {
        let key = format!("old-{i}");
        assert_eq!(
            claim(&store, &key, 1_000, Duration::from_secs(1)).await,
            Claim::Claimed
        );
    }
    store.purge_expired(None, 1_500, 5_000).await.unwrap();
    assert_eq!(current(&pool, &table).await, 1);
    let live = Duration::from_secs(100);
    assert_eq!(claim(&store, "live", 1_600, live).await, Claim::Claimed);
    let full = buckets(&pool, &table, 0).await;
    assert!(full.iter().all(|(_, size)| *size > 0), "{full:?}");

    // A report reads bucket 5 of generation 0 and stays open.
    let held = &full[5].0;
    let mut report = pool.begin().await.unwrap();
    sqlx::query(&format!("SELECT count(*) FROM {held}"))
        .execute(&mut *report)
        .await
        .unwrap();
    let stopped = store
        .purge_expired(None, 5_000, 5_000)
        .await
        .expect_err("a rotation stopped by a held bucket");
    assert!(stopped.is_infrastructure(), "{stopped}");
    let sizes: Vec<i64> = buckets(&pool, &table, 0)
        .await
        .into_iter()
        .map(|(_, size)| size)
        .collect();
    assert!(sizes[..5].iter().all(|s| *s == 0), "{sizes:?}");
    assert!(sizes[5..].iter().all(|s| *s > 0), "{sizes:?}");
    assert_eq!(current(&pool, &table).await, 1);
    assert!(is_duplicate(&claim(&store, "live", 5_000, live).await));

    // The report ends: the next purge empties the rest and switches.
    report.rollback().await.unwrap();
    store.purge_expired(None, 5_000, 5_000).await.unwrap();
    assert_eq!(current(&pool, &table).await, 0);
    assert_eq!(per_generation(&pool, &table).await, [0, 1]);
    let sizes = buckets(&pool, &table, 0).await;
    assert!(sizes.iter().all(|(_, size)| *size == 0), "{sizes:?}");
    assert!(is_duplicate(&claim(&store, "live", 5_100, live).await));
    assert_eq!(
        claim(&store, "old-7", 5_100, live).await,
        Claim::Claimed,
        "an expired key is new again"
    );
    assert!(is_duplicate(&claim(&store, "old-7", 5_200, live).await));
    drop_layout(&pool, &table).await;
}

/// A claim transaction open while a rotation runs keeps its key in the
/// generation it claimed it in: a copy of the key that arrives meanwhile
/// is a duplicate, never a second effect in the new generation, and the
/// rotation completes once the claim committed. The fence makes the
/// rotation wait for claims without queueing them: without it, the
/// rotation's `TRUNCATE` queues behind the open claim's partition locks,
/// the copy queues behind the `TRUNCATE`, and the rotation fails on its
/// lock timeout (seen: round 0, "rotation" failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_in_flight_across_a_rotation_is_never_doubled() {
    let table = unique("gen_fence");
    let charges = unique("gen_charges");
    let store = generations_store(&table).await;
    let pool = store.pool().clone();
    sqlx::query(&format!(
        "CREATE TABLE {charges} (k text NOT NULL, at_ms bigint NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    // Each round is 10 s after the last and its keys live 5 s: at every
    // round the other generation holds only expired keys, so every round
    // rotates while its first copy is in flight.
    let ttl = Duration::from_secs(5);
    for round in 0..4_i64 {
        let key = format!("K{round}");
        let now = 1_000 + round * 10_000;
        // First copy: claims, writes its charge and holds the transaction
        // open for 300 ms.
        let first = {
            let (store, key, charges) = (store.clone(), key.clone(), charges.clone());
            tokio::spawn(async move {
                let mut tx = store.begin().await.unwrap();
                let times = ClaimTimes::new(now, ttl);
                let c = store
                    .claim(&mut tx, SCOPE, times, &ClaimRequest::new(&key))
                    .await
                    .unwrap();
                if c == Claim::Claimed {
                    sqlx::query(&format!("INSERT INTO {charges} VALUES ($1, $2)"))
                        .bind(&key)
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    store.complete(&mut tx, SCOPE, &key, b"1").await.unwrap();
                    tx.commit().await.unwrap();
                }
                c
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let rotation = {
            let store = store.clone();
            tokio::spawn(async move { store.purge_expired(None, now, 5_000).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The second copy, while the first is still uncommitted and the
        // rotation under way.
        let second = claim(&store, &key, now + 1, ttl).await;
        assert_eq!(first.await.unwrap(), Claim::Claimed);
        rotation.await.unwrap().expect("rotation");
        assert!(
            is_duplicate(&second),
            "round {round}: the copy claimed during a rotation got {second:?}"
        );
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {charges} WHERE k = $1"))
            .bind(&key)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 1, "round {round}: {key} charged {n} times");
        assert_eq!(
            current(&pool, &table).await,
            i16::from(round % 2 == 0),
            "round {round} rotated"
        );
        // The key is still a duplicate after the rotation.
        assert!(is_duplicate(&claim(&store, &key, now + 2, ttl).await));
    }
    sqlx::query(&format!("DROP TABLE {charges}"))
        .execute(&pool)
        .await
        .ok();
    drop_layout(&pool, &table).await;
}

/// A plain table with records is prepared online (plain processes keep
/// claiming), then upgraded by `migrate` on a generations store: every
/// record stays and stays a duplicate, and the old table becomes
/// generation 0, truncated by a later rotation once its records expired.
#[tokio::test]
async fn a_plain_table_is_upgraded_in_place_keeping_its_records() {
    for prepared in [true, false] {
        let table = unique("gen_upgrade");
        let plain = pg_store(&pg_url(), &table).await;
        let pool = plain.pool().clone();
        let ttl = Duration::from_secs(10);
        for i in 0..100 {
            assert_eq!(
                claim_plain(&plain, &format!("old-{i}"), 1_000).await,
                Claim::Claimed
            );
        }
        if prepared {
            let generations = plain.clone().generations(true);
            generations.prepare_generations().await.expect("prepare");
            // Twice is fine (an interrupted preparation is run again).
            generations
                .prepare_generations()
                .await
                .expect("prepare again");
            // A plain process keeps working on a prepared table.
            assert_eq!(claim_plain(&plain, "during", 1_500).await, Claim::Claimed);
            assert!(is_duplicate(&claim_plain(&plain, "old-7", 1_500).await));
        }
        let store = generations_store(&table).await;
        assert!(
            PgStore::new(pool.clone())
                .with_table(&table)
                .unwrap()
                .detect_layout()
                .await
                .unwrap()
                .has_generations()
        );
        let expected = if prepared { 101 } else { 100 };
        assert_eq!(per_generation(&pool, &table).await, [expected, 0]);
        for i in [0, 42, 99] {
            assert!(
                is_duplicate(&claim(&store, &format!("old-{i}"), 2_000, ttl).await),
                "old-{i} after the upgrade"
            );
        }
        assert_eq!(claim(&store, "new", 2_000, ttl).await, Claim::Claimed);
        // The plain layout's migration refuses the upgraded table.
        let refused = plain
            .migrate()
            .await
            .expect_err("plain migrate on generations");
        assert!(
            refused.to_string().contains("generations layout"),
            "{refused}"
        );
        // Rotations: to the empty generation 1 at once, then, once every
        // old record expired (10 s after 1000), generation 0 is truncated.
        store.purge_expired(None, 3_000, 5_000).await.unwrap();
        assert_eq!(current(&pool, &table).await, 1);
        // Generation 0 was the old plain table: its first truncate splits
        // it into buckets like generation 1's.
        assert!(buckets(&pool, &table, 0).await.is_empty());
        store.purge_expired(None, 20_000, 5_000).await.unwrap();
        assert_eq!(current(&pool, &table).await, 0);
        assert_eq!(per_generation(&pool, &table).await, [0, 0]);
        assert_eq!(buckets(&pool, &table, 0).await.len(), 8);
        assert_eq!(claim(&store, "after", 20_000, ttl).await, Claim::Claimed);
        assert!(is_duplicate(&claim(&store, "after", 20_100, ttl).await));
        drop_layout(&pool, &table).await;
    }
}

/// A purging role that does not own an upgraded table, granted what
/// `onceonly doctor` lists, rotates it: the first rotation that empties
/// generation 0 (the old plain table) cannot split it into buckets without
/// the owner, so it truncates it unsplit instead of failing every purge;
/// a later rotation by the owner splits it.
#[tokio::test]
async fn a_role_that_does_not_own_an_upgraded_table_still_rotates_it() {
    let table = unique("gen_role");
    let url = pg_url();
    let plain = pg_store(&url, &table).await;
    let pool = plain.pool().clone();
    for i in 0..20 {
        assert_eq!(
            claim_plain(&plain, &format!("old-{i}"), 1_000).await,
            Claim::Claimed
        );
    }
    let owner = generations_store(&table).await;
    let role = unique("gen_purger");
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role} LOGIN; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {table}_attempts, {table}_fence, \
         {table}_steps TO {role}"
    ))
    .execute(&pool)
    .await
    .expect("role");
    let (_, host) = url.split_once('@').expect("user@host in the URL");
    let role_url = format!("postgres://{role}@{host}");
    // What the doctor says the role lacks, granted as it says.
    let doctor = onceonly(&[
        "doctor",
        "--database-url",
        &role_url,
        "--table",
        &table,
        "--no-outbox",
        "--json",
    ])
    .await;
    assert_eq!(doctor.code, 1, "{doctor:?}");
    let findings: serde_json::Value = serde_json::from_str(&doctor.stdout).expect("json");
    let fixes: Vec<&str> = findings["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["status"] == "fail")
        .map(|f| f["fix"].as_str().expect("fix"))
        .collect();
    assert_eq!(fixes.len(), 1, "the layout's grants only: {doctor:?}");
    sqlx::raw_sql(fixes[0])
        .execute(&pool)
        .await
        .expect("the doctor's grants");

    let purger = PgStore::connect(&role_url)
        .await
        .expect("connect as the role")
        .with_table(&table)
        .expect("table")
        .generations(true);
    purger
        .purge_expired(None, 3_000, 5_000)
        .await
        .expect("rotation to generation 1");
    assert_eq!(current(&pool, &table).await, 1);
    // Generation 0 is the old plain table: emptied, not split.
    purger
        .purge_expired(None, 20_000, 5_000)
        .await
        .expect("the rotation that empties the old table");
    assert_eq!(current(&pool, &table).await, 0);
    assert_eq!(per_generation(&pool, &table).await, [0, 0]);
    assert!(
        buckets(&pool, &table, 0).await.is_empty(),
        "split without the owner"
    );
    let ttl = Duration::from_secs(10);
    assert_eq!(claim(&purger, "after", 20_000, ttl).await, Claim::Claimed);
    assert!(is_duplicate(&claim(&purger, "after", 20_100, ttl).await));
    // The owner's rotations: to generation 1, then generation 0 again,
    // split this time.
    owner
        .purge_expired(None, 40_000, 5_000)
        .await
        .expect("rotation");
    owner
        .purge_expired(None, 60_000, 5_000)
        .await
        .expect("rotation");
    assert_eq!(current(&pool, &table).await, 0);
    assert_eq!(buckets(&pool, &table, 0).await.len(), 8);

    purger.pool().close().await;
    drop_layout(&pool, &table).await;
    sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .execute(&pool)
        .await
        .expect("drop the role");
}

async fn claim_plain(store: &PgStore, key: &str, now_ms: i64) -> Claim {
    let mut tx = store.begin().await.expect("begin");
    let times = ClaimTimes::new(now_ms, Duration::from_secs(10));
    let c = store
        .claim(&mut tx, SCOPE, times, &ClaimRequest::new(key))
        .await
        .expect("plain claim");
    if c == Claim::Claimed {
        tx.commit().await.expect("commit");
    }
    c
}

/// `onceonly migrate --layout generations` creates the layout, and the
/// other commands find it by themselves: `purge --expired` rotates.
#[tokio::test]
async fn the_cli_creates_the_layout_and_purges_by_rotation() {
    let table = unique("gen_cli");
    let outbox = unique("gen_cli_outbox");
    let url = pg_url();
    let migrate = onceonly(&[
        "migrate",
        "--database-url",
        &url,
        "--table",
        &table,
        "--outbox-table",
        &outbox,
        "--layout",
        "generations",
        "--buckets",
        "4",
    ])
    .await;
    assert!(migrate.success, "{migrate:?}");
    assert!(
        migrate.stdout.contains(&format!(
            "dedup table {table} is ready (postgres, generations layout)"
        )),
        "{migrate:?}"
    );
    let pool = PgPool::connect(&url).await.unwrap();
    assert_eq!(buckets(&pool, &table, 0).await.len(), 4);
    assert_eq!(buckets(&pool, &table, 1).await.len(), 4);
    let refused = onceonly(&[
        "migrate",
        "--database-url",
        &url,
        "--table",
        &table,
        "--layout",
        "generations",
        "--buckets",
        "0",
    ])
    .await;
    assert!(
        !refused.success && refused.stderr.contains("--buckets"),
        "{refused:?}"
    );
    assert!(
        migrate.stdout.contains(&format!(
            "outbox table {outbox} is ready (postgres, generations layout)"
        )),
        "{migrate:?}"
    );
    // The outbox commands find the outbox's layout too.
    let stats = onceonly(&[
        "outbox",
        "stats",
        "--database-url",
        &url,
        "--outbox-table",
        &outbox,
    ])
    .await;
    assert!(stats.success, "{stats:?}");
    let store = PgStore::connect(&url)
        .await
        .unwrap()
        .with_table(&table)
        .unwrap()
        .detect_layout()
        .await
        .unwrap();
    assert!(store.has_generations());
    let pool = store.pool().clone();
    // Keys that expired long ago, in generation 0.
    for i in 0..10 {
        claim(&store, &format!("k{i}"), 1_000, Duration::from_secs(1)).await;
    }
    // Two purges: the first rotates to the empty generation 1, the second
    // truncates generation 0 (every record there expired in 1970).
    for _ in 0..2 {
        let purge = onceonly(&[
            "purge",
            "--database-url",
            &url,
            "--table",
            &table,
            "--expired",
        ])
        .await;
        assert!(purge.success, "{purge:?}");
    }
    assert_eq!(per_generation(&pool, &table).await, [0, 0]);
    assert_eq!(current(&pool, &table).await, 0);
    // A second migrate keeps the layout without being told.
    let again = onceonly(&[
        "migrate",
        "--database-url",
        &url,
        "--table",
        &table,
        "--outbox-table",
        &outbox,
    ])
    .await;
    assert!(again.success, "{again:?}");
    assert_eq!(
        again.stdout.matches("generations layout").count(),
        2,
        "{again:?}"
    );
    // It keeps the buckets the table has, whatever --buckets says.
    assert_eq!(buckets(&pool, &table, 0).await.len(), 4);
    drop_layout(&pool, &table).await;
    drop_layout(&pool, &outbox).await;
}

/// `onceonly migrate --layout generations --prepare`, then `--layout
/// generations`: a plain table with records is upgraded in two steps.
#[tokio::test]
async fn the_cli_prepares_then_upgrades_a_plain_table() {
    let table = unique("gen_cli_up");
    let url = pg_url();
    let plain = pg_store(&url, &table).await;
    let pool = plain.pool().clone();
    for i in 0..20 {
        claim_plain(&plain, &format!("k{i}"), 1_000).await;
    }
    let base = [
        "migrate",
        "--database-url",
        &url,
        "--table",
        &table,
        "--no-outbox",
    ];
    let prepare = onceonly(&[&base[..], &["--layout", "generations", "--prepare"]].concat()).await;
    assert!(prepare.success, "{prepare:?}");
    assert!(prepare.stdout.contains("is prepared"), "{prepare:?}");
    let index_valid: bool =
        sqlx::query_scalar("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)")
            .bind(format!("{table}_g0_key"))
            .fetch_one(&pool)
            .await
            .expect("the prepared index");
    assert!(index_valid);
    let upgrade = onceonly(&[&base[..], &["--layout", "generations"]].concat()).await;
    assert!(upgrade.success, "{upgrade:?}");
    assert_eq!(per_generation(&pool, &table).await, [20, 0]);
    let store = generations_store(&table).await;
    assert!(is_duplicate(
        &claim(&store, "k3", 2_000, Duration::from_secs(1)).await
    ));
    drop_layout(&pool, &table).await;
}
