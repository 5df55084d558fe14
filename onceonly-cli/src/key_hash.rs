//! `onceonly key-hash`: how a key appears in spans and logs under an HMAC
//! key redaction, to find a known key's lines.

use clap::Args;
use onceonly::KeyRedaction;

use crate::{CliResult, out};

/// Print how keys appear in spans and logs under `KeyRedaction::hmac`
/// (`hmac:` and 16 hex digits), one line per key.
#[derive(Args, Debug)]
#[command(after_help = "\
The secret is read from an environment variable, never from the command line
(where `ps` and the shell history would show it): give it the bytes the
application gives KeyRedaction::hmac.

Examples:
  onceonly key-hash ORDER-4711
  onceonly key-hash --secret-env PAYMENTS_LOG_SECRET ORDER-4711 ORDER-4712
  grep \"$(onceonly key-hash ORDER-4711)\" app.log")]
pub struct KeyHashArgs {
    /// The environment variable that holds the secret.
    #[arg(long, value_name = "VAR", default_value = "ONCEONLY_KEY_SECRET")]
    secret_env: String,
    /// The keys (put `--` before a key that starts with `-`).
    #[arg(required = true)]
    keys: Vec<String>,
}

pub fn run(args: KeyHashArgs) -> CliResult {
    let secret = std::env::var_os(&args.secret_env)
        .ok_or_else(|| format!("the environment variable {} is not set", args.secret_env))?;
    let redaction = KeyRedaction::hmac(secret.as_encoded_bytes())?;
    for key in &args.keys {
        out!("{}", redaction.show(key));
    }
    Ok(())
}
