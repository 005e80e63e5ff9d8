//! Crash detection time and false positives of the membership protocol, in the
//! deterministic simulation (`moe_node::cluster::sim`) with the production foca config at
//! the default periods (`DEFAULT_PROBE_PERIOD`, `DEFAULT_SUSPICION_TIMEOUT`) and 1% packet loss.
//!
//! `cargo bench --bench membership_sim` (add `-- quick` for 5 trials and 10 minutes).

use std::time::{Duration, Instant};

use moe_node::cluster::sim::{SimConfig, Simulation};
use moe_node::cluster::{DEFAULT_PROBE_PERIOD, DEFAULT_SUSPICION_TIMEOUT};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

struct Row {
    members: usize,
    trials: usize,
    first: Vec<Duration>,
    last: Vec<Duration>,
    missed: usize,
    quiet: Duration,
    false_downs: usize,
    wall: Duration,
}

fn measure(members: usize, trials: usize, quiet: Duration) -> Row {
    let started = Instant::now();
    let mut first = Vec::new();
    let mut last = Vec::new();
    let mut missed = 0;
    for trial in 0..trials {
        let seed = 1000 + trial as u64;
        let mut simulation = Simulation::new(SimConfig::new(members, seed));
        if !simulation.run_until_converged(Duration::from_secs(300)) {
            eprintln!("{members} members, seed {seed}: did not converge");
        }
        // Crash at a moment unrelated to the probe cycles.
        simulation.run_for(Duration::from_millis(10_000 + seed * 7_919 % 1_000));
        let target = 1 + (seed as usize * 7919) % (members - 1);
        let crashed_at = simulation.now();
        simulation.crash(target);
        simulation.run_for(Duration::from_secs(60));
        let detection = simulation.detection(target, crashed_at);
        match (detection.first, detection.last) {
            (Some(f), Some(l)) => {
                first.push(f);
                last.push(l);
            }
            _ => missed += 1,
        }
    }
    // False positives: one long quiet run, nobody crashes.
    let mut simulation = Simulation::new(SimConfig::new(members, 77));
    simulation.run_until_converged(Duration::from_secs(300));
    simulation.run_for(quiet);
    let false_downs = simulation.false_downs().len();
    first.sort();
    last.sort();
    Row {
        members,
        trials,
        first,
        last,
        missed,
        quiet,
        false_downs,
        wall: started.elapsed(),
    }
}

fn main() {
    let quick = std::env::args().any(|arg| arg == "quick");
    let (trials, quiet) = if quick {
        (5, Duration::from_secs(600))
    } else {
        (20, Duration::from_secs(3600))
    };
    println!(
        "membership simulation: 1% loss, probe {:?}, suspicion {:?}, {trials} crash trials, \
         {} min quiet run",
        DEFAULT_PROBE_PERIOD,
        DEFAULT_SUSPICION_TIMEOUT,
        quiet.as_secs() / 60
    );
    println!(
        "| members | first p50 | first p99 | last p50 | last p99 | missed | false downs / quiet run | wall |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for members in [64, 256] {
        let row = measure(members, trials, quiet);
        println!(
            "| {} | {:.2} s | {:.2} s | {:.2} s | {:.2} s | {}/{} | {} in {} min | {:.1} s |",
            row.members,
            percentile(&row.first, 50.0).as_secs_f64(),
            percentile(&row.first, 99.0).as_secs_f64(),
            percentile(&row.last, 50.0).as_secs_f64(),
            percentile(&row.last, 99.0).as_secs_f64(),
            row.missed,
            row.trials,
            row.false_downs,
            row.quiet.as_secs() / 60,
            row.wall.as_secs_f64(),
        );
    }
}
