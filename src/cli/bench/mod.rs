//! `sluicegate bench`: benchmarks against real servers, one file per
//! subcommand (`redis.rs`: `drain`; `memory.rs`: `drain-memory`;
//! `pubsub.rs`: `drain-pubsub`; `sql.rs`: `drain-sql`; `hold.rs`;
//! `replicas.rs`; `soak/`), and what they measure with (`measure.rs`: wall and CPU
//! time, peak RSS, the instant gateway, the requests every drain
//! enqueues). Figures and commands: docs/benchmarks.md.

mod hold;
mod measure;
mod memory;
mod pubsub;
mod redis;
mod replicas;
mod soak;
mod sql;

use std::process::ExitCode;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Drain N messages from Redis through an instant gateway.
    Drain(redis::DrainArgs),
    /// Drain N messages from the in-memory queue through an instant
    /// gateway: the dispatch core without a transport.
    DrainMemory(memory::DrainMemoryArgs),
    /// Hold N concurrent slow requests in one dispatcher process.
    Hold(hold::HoldArgs),
    /// Drain N messages from a Pub/Sub subscription (the emulator or a
    /// real project) through an instant gateway.
    DrainPubsub(pubsub::DrainArgs),
    /// Drain N messages from PostgreSQL (the `sql` transport) through an
    /// instant gateway.
    DrainSql(sql::DrainSqlArgs),
    /// 1, 2, 4 replicas on one Redis queue with the shared window, against
    /// the simulator: global in flight against the window, throughput.
    Replicas(replicas::ReplicasArgs),
    /// A chaos soak on Redis, PostgreSQL or Pub/Sub, the gate reading a
    /// real Prometheus: replicas with the shared window killed and paused,
    /// gateway storms and server restarts on a seeded schedule; an account
    /// of every id at the end.
    Soak(soak::SoakArgs),
}

pub(super) async fn run(command: BenchCommand) -> ExitCode {
    let (name, outcome) = match command {
        BenchCommand::Drain(args) => ("drain", redis::drain(args).await),
        BenchCommand::DrainMemory(args) => ("drain-memory", memory::drain_memory(args).await),
        BenchCommand::Hold(args) => ("hold", hold::hold(args).await),
        BenchCommand::DrainPubsub(args) => ("drain-pubsub", pubsub::drain(args).await),
        BenchCommand::DrainSql(args) => ("drain-sql", sql::drain_sql(args).await),
        BenchCommand::Replicas(args) => ("replicas", replicas::replicas(args).await),
        BenchCommand::Soak(args) => ("soak", soak::soak(args).await),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench {name}: {e}");
            ExitCode::FAILURE
        }
    }
}
