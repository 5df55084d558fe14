//! The outbox table and its statements, per SQL dialect. Only validated
//! table names and this module's own constants are ever put into SQL
//! text; every value is bound.

use crate::store::{Dialect, TableName};

/// The default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "onceonly_outbox";

/// A row waits to be sent.
pub(crate) const PENDING: i16 = 0;
/// A row was confirmed by its destination.
pub(crate) const SENT: i16 = 1;
/// A row failed permanently, or too often: parked until retried by hand.
pub(crate) const DEAD: i16 = 2;

/// The first key of the advisory locks PostgreSQL enqueuers take on an
/// ordering key (the second is the key's hash): `'o' 'o' 'k' '1'`.
pub(crate) const ORDER_LOCK_CLASS: i32 = 0x6f6f_6b31;

/// The enqueue's 13 values as a PostgreSQL `SELECT` list, typed.
pub(crate) const PG_ENQUEUE_VALUES: &str = "$1::text, $2::text, $3::text, $4::text, $5::text, \
    $6::text, $7::text, $8::bytea, $9::text, $10::text, $11::bytea, $12::bigint, $13::bigint";

/// The columns a relay reads.
pub(crate) const ROW_COLS: &str = "id, message_id, scope, causation, traceparent, kind, destination, \
    routing_key, message_key, headers, payload, attempts";

/// Every statement of one outbox table.
#[derive(Debug)]
pub struct OutboxSql {
    pub table: String,
    pub ddl: Vec<String>,
    pub enqueue: String,
    /// Run before [`enqueue`](Self::enqueue) in the same transaction with
    /// the ordering key bound (MySQL; empty elsewhere): locks the key's
    /// row in the keys table until the enqueuer commits, so that the ids
    /// of one key's messages follow the order their transactions commit.
    pub enqueue_lock: String,
    /// The first pending row of each ordering key that is due (`$1` now,
    /// `$2` limit), locked, skipping rows another relay holds; `{kinds}`
    /// is replaced by the relay's kinds (this module's constants).
    heads: String,
    /// `... WHERE status = pending AND order_key IN (` + keys, then
    /// `) ORDER BY id LIMIT n` and `follow_lock`.
    pub follow_prefix: String,
    pub follow_lock: &'static str,
    /// `UPDATE .. SET next_attempt_at_ms = ` + until, then ids.
    pub lease_prefix: String,
    /// `$1` sent_at, then ids.
    pub sent_prefix: String,
    /// `$1` the new status (pending or dead), `$2` next attempt, `$3`
    /// error, `$4` id.
    pub failed: String,
    /// Rows, the oldest due `created_at_ms` and the delayed rows per
    /// status and kind (`$1`, `$2`: now).
    pub stats: String,
    /// Deletes at most `$2` rows sent before `$1`.
    pub purge_sent: String,
    /// Dead rows back to pending, due `$1`: all of them (`retry_all`), or
    /// one by message id (`$2`, `retry_one`).
    pub retry_all: String,
    pub retry_one: String,
    /// Rows of status `$1`, oldest first, at most `$2`.
    pub list: String,
    /// The row with message id `$1`.
    pub find: String,
    /// How a purge of sent rows rotates generations instead of deleting
    /// (PostgreSQL's generations layout; `None` otherwise).
    pub rotation: Option<super::generations::OutboxRotation>,
}

impl OutboxSql {
    /// The heads statement for a relay serving `kinds`.
    pub(crate) fn heads(&self, kinds: &[super::Kind]) -> String {
        let kinds: Vec<String> = kinds.iter().map(|k| format!("'{}'", k.as_str())).collect();
        self.heads.replace("{kinds}", &kinds.join(", "))
    }

    pub(crate) fn new(dialect: Dialect, table: &TableName) -> Self {
        let q = dialect.quote();
        let t = table.quoted(q);
        let p = |n| dialect.placeholder(n);
        // Partial indexes (PostgreSQL, SQLite): only pending rows are
        // searched by key, only sent rows by age.
        let idx_pending = format!(
            "CREATE INDEX IF NOT EXISTS {} ON {t} (order_key, id) WHERE status = 0",
            table.index("pending", q)
        );
        let idx_sent = format!(
            "CREATE INDEX IF NOT EXISTS {} ON {t} (sent_at_ms) WHERE status = 1",
            table.index("sent", q)
        );
        let (id_col, text, bytes, small) = match dialect {
            Dialect::Postgres => ("id BIGSERIAL PRIMARY KEY", "text", "bytea", "smallint"),
            Dialect::Sqlite => (
                "id INTEGER PRIMARY KEY AUTOINCREMENT",
                "TEXT",
                "BLOB",
                "INTEGER",
            ),
            Dialect::MySql => ("id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY", "", "", ""),
        };
        let mut ddl = match dialect {
            Dialect::MySql => vec![format!(
                "CREATE TABLE IF NOT EXISTS {t} ({id_col}, \
                 message_id VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, \
                 scope {v}(128) {u} NOT NULL, causation {v}(255) {u} NULL, \
                 traceparent {v}(128) {u} NULL, kind {v}(16) {u} NOT NULL, \
                 destination {v}(1024) {u} NOT NULL, routing_key {v}(255) {u} NULL, \
                 message_key VARBINARY(1024) NULL, \
                 order_key CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, \
                 headers TEXT {u} NOT NULL, payload LONGBLOB NOT NULL, \
                 status SMALLINT NOT NULL DEFAULT 0, attempts INT NOT NULL DEFAULT 0, \
                 next_attempt_at_ms BIGINT NOT NULL, last_error TEXT {u} NULL, \
                 created_at_ms BIGINT NOT NULL, sent_at_ms BIGINT NULL, \
                 UNIQUE KEY {} (message_id), KEY {} (status, order_key, id), \
                 KEY {} (status, sent_at_ms)) ENGINE=InnoDB",
                table.index("message_id", q),
                table.index("pending", q),
                table.index("sent", q),
                v = "VARCHAR",
                u = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
            )],
            _ => vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} ({id_col}, \
                     message_id {text} NOT NULL UNIQUE, scope {text} NOT NULL, \
                     causation {text}, traceparent {text}, kind {text} NOT NULL, \
                     destination {text} NOT NULL, routing_key {text}, message_key {bytes}, \
                     order_key {text} NOT NULL, headers {text} NOT NULL, payload {bytes} NOT NULL, \
                     status {small} NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, \
                     next_attempt_at_ms BIGINT NOT NULL, last_error {text}, \
                     created_at_ms BIGINT NOT NULL, sent_at_ms BIGINT)"
                ),
                idx_pending,
                idx_sent,
            ],
        };
        if dialect == Dialect::Postgres {
            // Concurrent `CREATE TABLE IF NOT EXISTS` can still collide in
            // the catalog: serialize migrations of this table with an
            // advisory lock, held until the DDL's transaction ends (the
            // validated name holds no quote).
            ddl.insert(
                0,
                format!("SELECT pg_advisory_xact_lock(hashtext('onceonly_outbox:{table}'))"),
            );
        }
        let insert_cols = "message_id, scope, causation, traceparent, kind, destination, \
             routing_key, message_key, order_key, headers, payload, next_attempt_at_ms, created_at_ms";
        let values = (1..=13).map(p).collect::<Vec<_>>().join(", ");
        // A key's messages leave in the order their transactions commit:
        // an enqueuer holds its ordering key until it commits (PostgreSQL:
        // a transaction-level advisory lock taken before the row's id is
        // drawn; MySQL: the key's row in `<outbox>_keys`; SQLite: one
        // writer at a time), so a later id of the key never commits
        // before an earlier one (the relay sends a key's rows by id).
        let enqueue = match dialect {
            // NOTIFY is transactional: relays wake when the claim commits.
            Dialect::Postgres => format!(
                "WITH ins AS (INSERT INTO {t} ({insert_cols}) SELECT {} \
                 FROM (SELECT pg_advisory_xact_lock({ORDER_LOCK_CLASS}, hashtext({}))) AS ordered \
                 ON CONFLICT (message_id) DO NOTHING RETURNING id) \
                 SELECT pg_notify({}, '') FROM ins",
                PG_ENQUEUE_VALUES,
                p(9),
                p(14)
            ),
            Dialect::Sqlite => format!(
                "INSERT INTO {t} ({insert_cols}) VALUES ({values}) ON CONFLICT (message_id) DO NOTHING"
            ),
            // Not INSERT IGNORE: that would also turn data errors into warnings.
            Dialect::MySql => format!(
                "INSERT INTO {t} ({insert_cols}) VALUES ({values}) ON DUPLICATE KEY UPDATE id = id"
            ),
        };
        let keys = table.suffixed("keys").quoted(q);
        let enqueue_lock = match dialect {
            Dialect::MySql => {
                ddl.push(format!(
                    "CREATE TABLE IF NOT EXISTS {keys} (\
                     order_key CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY) \
                     ENGINE=InnoDB"
                ));
                format!(
                    "INSERT INTO {keys} (order_key) VALUES (?) ON DUPLICATE KEY UPDATE order_key = order_key"
                )
            }
            _ => String::new(),
        };
        let lock = match dialect {
            Dialect::Postgres | Dialect::MySql => " FOR UPDATE SKIP LOCKED",
            // One writer at a time: the relay's transaction is BEGIN IMMEDIATE.
            Dialect::Sqlite => "",
        };
        // Each key's first pending row, found in one pass over the pending
        // index (a `NOT EXISTS` per row made this quadratic in a key's
        // backlog: 20 ms for 5,000 rows of 32 keys, against 2 ms).
        // PostgreSQL: as an array computed once, whatever the statistics
        // (on a table not analyzed yet, `IN (..)` was planned as a nested
        // loop re-running the aggregate per row).
        let first_of_keys =
            format!("SELECT MIN(e.id) FROM {t} e WHERE e.status = 0 GROUP BY e.order_key");
        let is_head = match dialect {
            Dialect::Postgres => format!("o.id = ANY(ARRAY({first_of_keys}))"),
            Dialect::MySql | Dialect::Sqlite => format!("o.id IN ({first_of_keys})"),
        };
        let heads = format!(
            "SELECT {ROW_COLS}, order_key FROM {t} o WHERE {is_head} \
             AND o.status = 0 AND o.kind IN ({{kinds}}) AND o.next_attempt_at_ms <= {} \
             ORDER BY o.id LIMIT {}{lock}",
            p(1),
            p(2)
        );
        let follow_prefix = format!(
            "SELECT {ROW_COLS}, order_key, next_attempt_at_ms FROM {t} WHERE status = 0 AND order_key IN ("
        );
        let follow_lock = match dialect {
            Dialect::Sqlite => "",
            _ => " FOR UPDATE",
        };
        let sent_prefix = format!(
            "UPDATE {t} SET status = 1, attempts = attempts + 1, last_error = NULL, sent_at_ms = "
        );
        let lease_prefix = format!("UPDATE {t} SET next_attempt_at_ms = ");
        // The relay decides whether the row is dead; the statement records it.
        let failed = format!(
            "UPDATE {t} SET status = {}, attempts = attempts + 1, next_attempt_at_ms = {}, \
             last_error = {} WHERE status = 0 AND id = {}",
            p(1),
            p(2),
            p(3),
            p(4)
        );
        // `$1` and `$2`: now. Delayed rows (pending, not due yet) are
        // counted apart and do not age.
        let stats = format!(
            "SELECT status, kind, COUNT(*) AS n, \
             MIN(CASE WHEN created_at_ms <= {} THEN created_at_ms END) AS oldest_ms, \
             COUNT(CASE WHEN status = 0 AND created_at_ms > {} THEN 1 END) AS delayed_n \
             FROM {t} GROUP BY status, kind ORDER BY status, kind",
            p(1),
            p(2)
        );
        let purge_sent = match dialect {
            Dialect::MySql => format!(
                "DELETE FROM {t} WHERE status = 1 AND sent_at_ms < ? ORDER BY sent_at_ms LIMIT ?"
            ),
            Dialect::Postgres => format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE status = 1 \
                 AND sent_at_ms < $1 ORDER BY sent_at_ms LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ),
            Dialect::Sqlite => format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE status = 1 \
                 AND sent_at_ms < $1 ORDER BY sent_at_ms LIMIT $2)"
            ),
        };
        let retry_all = format!(
            "UPDATE {t} SET status = 0, attempts = 0, last_error = NULL, next_attempt_at_ms = {} \
             WHERE status = 2",
            p(1)
        );
        let retry_one = format!("{retry_all} AND message_id = {}", p(2));
        let cols = format!(
            "{ROW_COLS}, order_key, status, last_error, created_at_ms, sent_at_ms, next_attempt_at_ms"
        );
        let list = format!(
            "SELECT {cols} FROM {t} WHERE status = {} ORDER BY id LIMIT {}",
            p(1),
            p(2)
        );
        let find = format!("SELECT {cols} FROM {t} WHERE message_id = {}", p(1));
        Self {
            stats,
            purge_sent,
            retry_all,
            retry_one,
            list,
            find,
            table: t,
            ddl,
            enqueue,
            enqueue_lock,
            heads,
            follow_prefix,
            follow_lock,
            lease_prefix,
            sent_prefix,
            failed,
            rotation: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_bind_every_value() {
        for dialect in [Dialect::Postgres, Dialect::MySql, Dialect::Sqlite] {
            let sql = OutboxSql::new(dialect, &TableName::new("box").expect("name"));
            // PostgreSQL binds the ordering key ($9) twice: the row's and
            // the key's advisory lock.
            let marks = sql.enqueue.matches('?').count() + sql.enqueue.matches('$').count();
            let expected = if dialect == Dialect::Postgres { 15 } else { 13 };
            assert_eq!(marks, expected, "{dialect:?}: {}", sql.enqueue);
            let lock_marks = sql.enqueue_lock.matches('?').count();
            let lock_expected = usize::from(dialect == Dialect::MySql);
            assert_eq!(
                lock_marks, lock_expected,
                "{dialect:?}: {}",
                sql.enqueue_lock
            );
        }
    }
}
