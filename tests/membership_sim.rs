//! Membership in a deterministic simulation: foca with the production config, a virtual
//! clock and lossy in-memory links (see `moe_node::cluster::sim`).

use std::time::Duration;

use moe_node::cluster::sim::{SimConfig, Simulation};

fn converged(members: usize, seed: u64) -> Simulation {
    let mut simulation = Simulation::new(SimConfig::new(members, seed));
    assert!(
        simulation.run_until_converged(Duration::from_secs(120)),
        "{members} members did not converge in 120 virtual seconds"
    );
    simulation
}

#[test]
fn a_crashed_member_is_declared_dead_by_every_live_member() {
    for seed in [1, 2, 3] {
        let mut simulation = converged(24, seed);
        simulation.run_for(Duration::from_secs(5));
        let crashed_at = simulation.now();
        simulation.crash(7);
        simulation.run_for(Duration::from_secs(30));
        let detection = simulation.detection(7, crashed_at);
        let last = detection
            .last
            .unwrap_or_else(|| panic!("seed {seed}: {} live members missed it", detection.missing));
        // A probe finds it within a couple of periods, suspicion lasts 2 s, gossip spreads
        // the verdict in well under a second.
        assert!(
            last <= Duration::from_secs(12),
            "seed {seed}: last detection {last:?}"
        );
        assert!(
            simulation.false_downs().is_empty(),
            "seed {seed}: live members declared down: {:?}",
            simulation.false_downs()
        );
    }
}

#[test]
fn a_long_quiet_run_declares_no_live_member_dead() {
    let mut simulation = converged(32, 11);
    simulation.run_for(Duration::from_secs(15 * 60));
    let (sent, lost) = simulation.packets();
    assert!(
        lost > 0 && lost < sent / 50,
        "the links lose about 1%: {lost} of {sent}"
    );
    assert!(
        simulation.false_downs().is_empty(),
        "live members declared down: {:?}",
        simulation.false_downs()
    );
    assert!(simulation.converged());
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let run = |seed| {
        let mut simulation = converged(16, seed);
        let crashed_at = simulation.now();
        simulation.crash(3);
        simulation.run_for(Duration::from_secs(20));
        (
            simulation.packets(),
            simulation.down_reports().to_vec(),
            simulation.detection(3, crashed_at),
        )
    };
    assert_eq!(run(5), run(5));
}
