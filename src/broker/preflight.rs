//! A consumer's first start says what is wrong: before it consumes
//! anything, it reads its dedup table once. A table that does not exist
//! (`migrate` never ran) stops the start at once with the command that
//! creates it, instead of a consumer that waits for it for ever; any other
//! fault (the database down, slow, read-only) is waited out in place as
//! usual, and so is a table that disappears later.

use crate::engine::Engine;
use crate::store::{InfraFault, SqlStore};

/// A key no delivery can have (a control character), read to probe the
/// dedup table.
const PROBE_KEY: &str = "\u{1}onceonly:preflight";

/// Why the consumer of `engine` cannot start, if its dedup table is
/// missing: the message that says how to create it.
pub(crate) async fn missing_schema<S: SqlStore>(engine: &Engine<S>) -> Option<String> {
    let store = engine.store();
    let error = store.get(engine.scope(), PROBE_KEY).await.err()?;
    if error.infra_fault() != Some(InfraFault::MissingSchema) {
        return None;
    }
    let table = store.table();
    Some(format!(
        "the dedup table {table} (or part of its schema) is missing ({error}): create it with \
         `onceonly migrate --database-url <URL> --table {table}`, or in code with \
         `store.migrate().await?` (trait `onceonly::SqlStore`) before the consumer starts"
    ))
}
