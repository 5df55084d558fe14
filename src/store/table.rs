//! Validated SQL identifiers for the dedup table.

use std::fmt;

use super::StoreError;

/// A dedup table name, optionally schema-qualified (`schema.table`).
///
/// Each part must match `[A-Za-z_][A-Za-z0-9_]*`, and the table part is at
/// most 48 bytes so that derived index names stay within every backend's
/// identifier limit. Backends quote it anyway, so reserved words are fine.
/// No SQL is ever built from an unvalidated name.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

impl TableName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::InvalidTableName(name.chars().take(100).collect());
        let (schema, table) = match name.split_once('.') {
            Some((s, t)) => (Some(s), t),
            None => (None, name),
        };
        for part in schema.iter().copied().chain([table]) {
            let mut bytes = part.bytes();
            let first_ok = bytes
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
            if !first_ok
                || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
                || part.len() > 48
            {
                return Err(bad());
            }
        }
        Ok(Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// The unqualified table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema, if qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The name quoted with `quote` (`"` for Postgres and SQLite, `` ` `` for MySQL).
    pub fn quoted(&self, quote: char) -> String {
        match &self.schema {
            Some(s) => format!("{quote}{s}{quote}.{quote}{}{quote}", self.table),
            None => format!("{quote}{}{quote}", self.table),
        }
    }

    /// The attempts table of this dedup table: `<table>_attempts`, in the
    /// same schema (the crash counter of suspect deliveries, see
    /// [`SqlStore::bump_attempts`](super::SqlStore::bump_attempts)). At most
    /// 57 bytes, within every backend's identifier limit.
    pub fn attempts(&self) -> TableName {
        self.suffixed("attempts")
    }

    /// The fence table of this dedup table: `<table>_fence`, in the same
    /// schema, one row per (scope, entity) holding the highest order
    /// applied (see [`SqlStore::advance_fence`](super::SqlStore::advance_fence)).
    pub fn fence(&self) -> TableName {
        self.suffixed("fence")
    }

    /// The steps table of this dedup table: `<table>_steps`, in the same
    /// schema, one row per finished step of a key's handler (see
    /// [`SqlStore::record_step`](super::SqlStore::record_step)).
    pub fn steps(&self) -> TableName {
        self.suffixed("steps")
    }

    /// The control table of PostgreSQL's generations layout on this table
    /// (dedup table or outbox): `<table>_generation`, in the same schema,
    /// one row naming the current generation. Claims and enqueues read it;
    /// a rotation updates it.
    pub fn generation_control(&self) -> TableName {
        self.suffixed("generation")
    }

    /// `<table>_<suffix>` in the same schema (at most 48 + 1 + the
    /// suffix's bytes: keep suffixes within 14 bytes for every backend's
    /// 63-byte identifier limit).
    pub(crate) fn suffixed(&self, suffix: &str) -> TableName {
        Self {
            schema: self.schema.clone(),
            table: format!("{}_{suffix}", self.table),
        }
    }

    /// An index name derived from the table name, quoted, unqualified.
    pub fn index(&self, suffix: &str, quote: char) -> String {
        format!("{quote}{}_{suffix}{quote}", self.table)
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            schema: None,
            table: super::DEFAULT_TABLE.to_owned(),
        }
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableName({self})")
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.table),
            None => f.write_str(&self.table),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_identifiers_and_schema_qualified_names() {
        assert_eq!(
            TableName::new("onceonly_keys").unwrap().quoted('"'),
            "\"onceonly_keys\""
        );
        assert_eq!(
            TableName::new("ops.Keys_2").unwrap().quoted('`'),
            "`ops`.`Keys_2`"
        );
        assert_eq!(
            TableName::new("order").unwrap().index("expires", '"'),
            "\"order_expires\""
        );
        assert_eq!(
            TableName::new("ops.keys").unwrap().attempts().quoted('"'),
            "\"ops\".\"keys_attempts\""
        );
    }

    #[test]
    fn rejects_anything_that_could_inject_sql() {
        for bad in [
            "",
            "1keys",
            "keys; DROP TABLE x",
            "keys\"",
            "a.b.c",
            ".keys",
            "keys.",
            "k-eys",
            "ключи",
            &"k".repeat(49),
        ] {
            assert!(TableName::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
