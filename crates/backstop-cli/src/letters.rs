//! `backstop letters`: dead letters on a Redis stream.

use crate::{
    Failure,
    render::{print_json, table},
};
use backstop::dead_letters_redis::{DeadLetterStream, StreamLetter};
use clap::{Args, Subcommand};
use serde_json::Value;

#[derive(Args, Debug)]
pub(crate) struct LettersArgs {
    /// The Redis holding the stream.
    #[arg(
        long,
        env = "BACKSTOP_REDIS",
        default_value = "redis://127.0.0.1:6379/",
        global = true
    )]
    redis: String,
    /// The stream.
    #[arg(long, default_value = "dead-letters", global = true)]
    stream: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: LettersCommand,
}

#[derive(Subcommand, Debug)]
enum LettersCommand {
    /// The letters on the stream, oldest first.
    List {
        /// How many.
        #[arg(long, default_value_t = 50)]
        count: usize,
    },
    /// Letters no one in the group has been given yet, given to this consumer (pending until
    /// acknowledged).
    Read {
        /// The consumer group (created when missing).
        #[arg(long)]
        group: String,
        /// Who reads.
        #[arg(long)]
        consumer: String,
        /// How many.
        #[arg(long, default_value_t = 10)]
        count: usize,
    },
    /// Acknowledges settled letters for the group.
    Ack {
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// The letters' ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

fn redis_failed(e: impl std::fmt::Display) -> Failure {
    Failure {
        code: 1,
        message: format!("the dead-letter stream's Redis failed: {e}"),
    }
}

pub(crate) async fn run(args: LettersArgs) -> Result<u8, Failure> {
    let stream = DeadLetterStream::connect(&args.redis, &args.stream)
        .await
        .map_err(|e| Failure {
            code: 1,
            message: format!("cannot reach Redis at {}: {e}", args.redis),
        })?;
    match args.command {
        LettersCommand::List { count } => {
            let letters = stream.list(count).await.map_err(redis_failed)?;
            show(&letters, args.json, "no dead letters on the stream");
        }
        LettersCommand::Read {
            group,
            consumer,
            count,
        } => {
            stream.create_group(&group).await.map_err(redis_failed)?;
            let letters = stream
                .read(&group, &consumer, count)
                .await
                .map_err(redis_failed)?;
            show(&letters, args.json, "no letter waits for this group");
        }
        LettersCommand::Ack { group, ids } => {
            let acked = stream.ack(&group, &ids).await.map_err(redis_failed)?;
            if args.json {
                print_json(&serde_json::json!({ "acknowledged": acked }));
            } else {
                println!("{acked} of {} acknowledged for group {group}", ids.len());
            }
        }
    }
    Ok(0)
}

fn show(letters: &[StreamLetter], json: bool, none: &str) {
    if json {
        let v = letters
            .iter()
            .map(|l| serde_json::json!({ "id": l.id, "letter": l.letter }))
            .collect();
        print_json(&Value::Array(v));
        return;
    }
    if letters.is_empty() {
        println!("{none}");
        return;
    }
    let mut t = table(&["id", "dependency", "outcome", "kind", "run", "key", "cause"]);
    let field =
        |l: &StreamLetter, name: &str| l.letter[name].as_str().unwrap_or_default().to_owned();
    for l in letters {
        t.add_row(vec![
            l.id.clone(),
            field(l, "dependency"),
            field(l, "outcome"),
            field(l, "kind"),
            field(l, "run_id"),
            field(l, "idempotency_key"),
            field(l, "cause"),
        ]);
    }
    println!("{t}");
}
