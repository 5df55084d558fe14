//! Which SQL database a table lives in ([`Dialect`]) and how the table is
//! laid out ([`Layout`]): the two values every statement of the dedup
//! store, the outbox and the CLI is built from.

/// The SQL database a store, an outbox or the CLI talks to. Each backend
/// owns one (`PgStore`, `MySqlStore`, `SqliteStore` and the outbox on the
/// same sqlx database share it); nothing re-derives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dialect {
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    MySql,
    /// SQLite.
    Sqlite,
}

impl Dialect {
    /// Lower-case name: `postgres`, `mysql`, `sqlite`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Sqlite => "sqlite",
        }
    }

    /// The identifier quote (`"` or `` ` ``).
    pub(crate) const fn quote(self) -> char {
        match self {
            Self::MySql => '`',
            Self::Postgres | Self::Sqlite => '"',
        }
    }

    /// Whether text columns are byte strings (MySQL's byte-exact
    /// `VARBINARY` and binary collations): they decode from bytes that must
    /// be UTF-8, and prefixes are measured in bytes.
    pub(crate) const fn byte_text(self) -> bool {
        matches!(self, Self::MySql)
    }

    /// The `n`-th bind placeholder (1-based): `$n`, or `?` on MySQL.
    pub(crate) fn placeholder(self, n: usize) -> String {
        match self {
            Self::MySql => "?".to_owned(),
            Self::Postgres | Self::Sqlite => format!("${n}"),
        }
    }
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a dedup table is laid out. The statements of a store are built from
/// its table, its [`Dialect`] and its layout together, in one place
/// (`Backend::sql`): a store cannot run the plain layout's statements on a
/// generations table by forgetting a setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Layout {
    /// One table, expired records deleted in batches (every backend).
    #[default]
    Plain,
    /// PostgreSQL's generations: two partitions, each split into `buckets`
    /// (1 ..= [`MAX_GENERATION_BUCKETS`](super::MAX_GENERATION_BUCKETS)),
    /// purged by rotating and truncating the older one (see
    /// [`PgStore::generations`](crate::PgStore::generations)).
    Generations {
        /// The hash buckets of each generation
        /// (see [`PgStore::generation_buckets`](crate::PgStore::generation_buckets)).
        buckets: u16,
    },
}

impl Layout {
    /// Whether this is the generations layout.
    pub const fn is_generations(self) -> bool {
        matches!(self, Self::Generations { .. })
    }
}
