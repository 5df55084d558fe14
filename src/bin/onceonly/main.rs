//! The `onceonly` command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(any(feature = "amqp", feature = "kafka"))]
mod replay;

/// Operations on onceonly deployments.
#[derive(Parser, Debug)]
#[command(name = "onceonly", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay dead letters back to where they came from.
    #[cfg(any(feature = "amqp", feature = "kafka"))]
    Replay(replay::ReplayArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        #[cfg(any(feature = "amqp", feature = "kafka"))]
        Command::Replay(args) => replay::run(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
