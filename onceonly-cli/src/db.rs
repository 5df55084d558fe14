//! Opening the dedup store a `--database-url` names.

use onceonly::store::StoreError;

/// An open store of one of the compiled-in backends.
pub enum Db {
    #[cfg(feature = "postgres")]
    Postgres(onceonly::PgStore),
    #[cfg(feature = "mysql")]
    MySql(onceonly::MySqlStore),
    #[cfg(feature = "sqlite")]
    Sqlite(onceonly::SqliteStore),
}

/// Runs `$body` with `$s` bound to the store inside `$db`, whatever its backend.
macro_rules! with_store {
    ($db:expr, |$s:ident| $body:expr) => {
        match $db {
            #[cfg(feature = "postgres")]
            $crate::db::Db::Postgres($s) => $body,
            #[cfg(feature = "mysql")]
            $crate::db::Db::MySql($s) => $body,
            #[cfg(feature = "sqlite")]
            $crate::db::Db::Sqlite($s) => $body,
        }
    };
}
pub(crate) use with_store;

/// Why a database URL cannot be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The URL's scheme names no backend, or one not compiled in.
    #[error(
        "unsupported database URL {0:?}: expected postgres://, mysql:// (or mariadb://) or sqlite: \
         (this build supports: {supported})",
        supported = supported()
    )]
    Unsupported(String),
    /// The SQLite database file does not exist (only `migrate` creates it).
    #[error("no SQLite database at {0:?}: create it with `onceonly migrate`")]
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    NoSuchFile(String),
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No `--database-url`, `ONCEONLY_DATABASE_URL` nor `DATABASE_URL`.
    #[error("no database URL: pass --database-url or set ONCEONLY_DATABASE_URL (or DATABASE_URL)")]
    NoUrl,
}

/// The database URL: `--database-url` or `ONCEONLY_DATABASE_URL` (`flag`,
/// resolved by clap), else `DATABASE_URL`, sqlx's convention. Empty values
/// count as unset.
pub fn database_url(flag: Option<&str>) -> Result<String, OpenError> {
    flag.filter(|u| !u.is_empty())
        .map(str::to_owned)
        .or_else(|| std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()))
        .ok_or(OpenError::NoUrl)
}

fn supported() -> String {
    let mut v: Vec<&str> = Vec::new();
    if cfg!(feature = "postgres") {
        v.push("postgres");
    }
    if cfg!(feature = "mysql") {
        v.push("mysql");
    }
    if cfg!(feature = "sqlite") {
        v.push("sqlite");
    }
    if v.is_empty() {
        "none: rebuild with --features postgres, mysql or sqlite".into()
    } else {
        v.join(", ")
    }
}

impl Db {
    /// Connects to `url` and selects dedup table `table`. An SQLite file is
    /// created only if `create` (by `migrate`).
    #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
    pub async fn open(url: &str, table: &str, create: bool) -> Result<Self, OpenError> {
        let scheme = url.split_once(':').map_or("", |(s, _)| s);
        match scheme {
            #[cfg(feature = "postgres")]
            // The table's own layout (plain or generations).
            "postgres" | "postgresql" => Ok(Self::Postgres(
                onceonly::PgStore::connect(url)
                    .await?
                    .with_table(table)?
                    .detect_layout()
                    .await?,
            )),
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => {
                let url = url.replacen("mariadb:", "mysql:", 1);
                Ok(Self::MySql(
                    onceonly::MySqlStore::connect(&url)
                        .await?
                        .with_table(table)?,
                ))
            }
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                // sqlx's URL conventions (`sqlite://path?mode=rwc`,
                // `sqlite:path`, `sqlite::memory:`); only `migrate` creates
                // a missing file.
                use std::str::FromStr as _;
                let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)
                    .map_err(|e| OpenError::Store(e.into()))?;
                let path = options.get_filename().to_owned();
                let in_memory = path == std::path::Path::new(":memory:");
                if !create && !in_memory && !path.exists() {
                    return Err(OpenError::NoSuchFile(path.display().to_string()));
                }
                let options = options.create_if_missing(create);
                Ok(Self::Sqlite(
                    onceonly::SqliteStore::connect_with(options)
                        .await?
                        .with_table(table)?,
                ))
            }
            _ => Err(OpenError::Unsupported(redact(url))),
        }
    }

    /// The database, for [`onceonly::ops::admin::migration_sql`].
    pub fn dialect(&self) -> onceonly::ops::admin::Dialect {
        use onceonly::ops::admin::Dialect;
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => Dialect::Postgres,
            #[cfg(feature = "mysql")]
            Self::MySql(_) => Dialect::MySql,
            #[cfg(feature = "sqlite")]
            Self::Sqlite(_) => Dialect::Sqlite,
        }
    }

    /// The dedup table's layout, for [`onceonly::ops::admin::migration_sql`].
    pub fn layout(&self) -> onceonly::store::Layout {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => s.layout_of_table(),
            #[allow(unreachable_patterns)]
            _ => onceonly::store::Layout::Plain,
        }
    }

    /// The backend's name.
    pub fn backend(&self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Self::MySql(_) => "mysql",
            #[cfg(feature = "sqlite")]
            Self::Sqlite(_) => "sqlite",
        }
    }
}

/// The URL with any password replaced, for error messages.
pub fn redact(url: &str) -> String {
    // A password in the query string (`?password=...`): drop the query.
    let url = match url.split_once('?') {
        Some((base, query)) if query.to_ascii_lowercase().contains("password") => {
            return format!("{}?***", redact(base));
        }
        _ => url,
    };
    match (url.find("://"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            let creds = &url[start + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}://{user}:***@{}", &url[..start], &url[at + 1..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            super::redact("postgres://u:secret@h/db"),
            "postgres://u:***@h/db"
        );
        assert_eq!(super::redact("sqlite:x.db"), "sqlite:x.db");
        assert_eq!(
            super::redact("mysql://u@h/db?password=secret"),
            "mysql://u@h/db?***"
        );
    }
}
