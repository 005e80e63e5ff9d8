//! Membership over real UDP sockets on 127.0.0.1 with short periods (200 ms probe, 600 ms
//! suspicion), each test on its own ports.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{MemberMeta, MemberState, Membership, MembershipConfig, TableId};

const PROBE: Duration = Duration::from_millis(200);
const SUSPICION: Duration = Duration::from_millis(600);
const MODEL: u64 = 0xfeed;
/// Room for a loaded test machine (two cores shared with compilers) on top of what the
/// protocol promises.
const SLACK: Duration = Duration::from_secs(2);

fn config(
    node: &str,
    bind: SocketAddr,
    seeds: &[SocketAddr],
    key: &str,
    model: u64,
) -> MembershipConfig {
    MembershipConfig {
        bind,
        advertise_host: None,
        seeds: seeds.to_vec(),
        keys: vec![key.to_string()],
        probe_period: PROBE,
        suspicion_timeout: SUSPICION,
        meta: MemberMeta {
            node: node.to_string(),
            peer: "127.0.0.1:7000".parse().expect("addr"),
            api: "127.0.0.1:8000".parse().expect("addr"),
            devices: 2,
            rows_bf16: false,
            model,
            placement_version: 1,
            loaded_version: 1,
            placement_hash: 0,
            loaded_hash: 0,
            expert_room: u64::MAX,
            expert_bytes: 0,
            expert_slots: Vec::new(),
        },
    }
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

fn start(node: &str, seeds: &[SocketAddr]) -> Membership {
    Membership::start(config(node, any_port(), seeds, "secret", MODEL)).expect("starts")
}

/// Polls `condition` every 20 ms until it holds or `limit` passes; returns the wait.
fn wait_for(limit: Duration, mut condition: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if condition() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn state_of(observer: &Membership, node: &str) -> Option<MemberState> {
    observer
        .members()
        .into_iter()
        .find(|view| view.meta.node == node && !view.is_self)
        .map(|view| view.state)
}

fn all_alive(members: &[&Membership], count: usize) -> bool {
    members.iter().all(|membership| {
        let views = membership.members();
        views.len() == count && views.iter().all(|view| view.state == MemberState::Alive)
    })
}

fn three() -> (Membership, Membership, Membership) {
    let a = start("a", &[]);
    let b = start("b", &[a.local_addr()]);
    let c = start("c", &[a.local_addr()]);
    let joined = wait_for(Duration::from_secs(5) + SLACK, || {
        all_alive(&[&a, &b, &c], 3)
    });
    assert!(
        joined.is_some(),
        "three members did not see each other: {:?}",
        a.members()
    );
    (a, b, c)
}

#[test]
fn three_members_join_through_one_seed_and_all_see_three_alive() {
    let (a, b, c) = three();
    for membership in [&a, &b, &c] {
        let views = membership.members();
        assert_eq!(views.iter().filter(|view| view.is_self).count(), 1);
        assert!(views[0].is_self);
        let mut nodes: Vec<_> = views.iter().map(|view| view.meta.node.clone()).collect();
        nodes.sort();
        assert_eq!(nodes, ["a", "b", "c"]);
        assert!(membership.stats().transitions.alive.load(Ordering::Relaxed) >= 2);
        assert_eq!(membership.stats().packets_rejected.total(), 0);
    }
    let view_of_b = a.members().into_iter().find(|view| view.meta.node == "b");
    assert_eq!(view_of_b.map(|view| view.gossip), Some(b.local_addr()));
}

#[test]
fn a_member_that_leaves_is_dead_at_once() {
    let (a, b, c) = three();
    b.leave();
    let took = wait_for(PROBE * 2 + SLACK, || {
        state_of(&a, "b") == Some(MemberState::Dead) && state_of(&c, "b") == Some(MemberState::Dead)
    });
    assert!(took.is_some(), "after leave: {:?}", a.members());
    assert!(took.is_some_and(|took| took < SUSPICION + SLACK));
    assert_eq!(state_of(&a, "c"), Some(MemberState::Alive));
}

#[test]
fn a_crashed_member_is_dead_within_three_probes_and_the_suspicion_timeout() {
    let (a, b, c) = three();
    let mut changes = a.changes();
    changes.mark_unchanged();
    c.halt();
    let bound = PROBE * 3 + SUSPICION;
    let took = wait_for(bound + SLACK, || {
        state_of(&a, "c") == Some(MemberState::Dead) && state_of(&b, "c") == Some(MemberState::Dead)
    });
    assert!(took.is_some(), "crashed member not dead: {:?}", a.members());
    eprintln!("crash detected in {took:?} (protocol bound {bound:?})");
    assert!(changes.has_changed().unwrap_or(false), "watchers were told");
    assert!(a.stats().transitions.dead.load(Ordering::Relaxed) >= 1);
    assert_eq!(state_of(&a, "b"), Some(MemberState::Alive));
}

#[test]
fn a_restarted_member_comes_back_alive_with_a_newer_identity() {
    let (a, b, c) = three();
    let address = c.local_addr();
    let before = a
        .members()
        .into_iter()
        .find(|view| view.meta.node == "c")
        .map(|view| view.generation)
        .expect("c known");
    c.halt();
    let dead = wait_for(PROBE * 3 + SUSPICION + SLACK, || {
        state_of(&a, "c") == Some(MemberState::Dead) && state_of(&b, "c") == Some(MemberState::Dead)
    });
    assert!(dead.is_some());
    let restarted = Membership::start(config("c", address, &[a.local_addr()], "secret", MODEL))
        .expect("rebinds");
    assert_eq!(restarted.local_addr(), address);
    let back = wait_for(Duration::from_secs(3) + SLACK, || {
        all_alive(&[&a, &b, &restarted], 3)
    });
    assert!(
        back.is_some(),
        "restart not alive everywhere: {:?}",
        a.members()
    );
    for observer in [&a, &b] {
        let view = observer
            .members()
            .into_iter()
            .find(|view| view.meta.node == "c")
            .expect("c known");
        assert!(view.generation > before, "newer identity wins");
        assert_eq!(view.gossip, address);
    }
}

#[test]
fn a_member_with_the_wrong_secret_never_appears() {
    let a = start("a", &[]);
    let b = start("b", &[a.local_addr()]);
    let intruder = Membership::start(config(
        "intruder",
        any_port(),
        &[a.local_addr()],
        "guess",
        MODEL,
    ))
    .expect("starts");
    assert!(wait_for(Duration::from_secs(3) + SLACK, || all_alive(&[&a, &b], 2)).is_some());
    std::thread::sleep(PROBE * 5);
    for membership in [&a, &b] {
        assert!(
            state_of(membership, "intruder").is_none(),
            "{:?}",
            membership.members()
        );
    }
    assert_eq!(intruder.members().len(), 1, "the intruder stays alone");
    assert!(a.stats().packets_rejected.total() > 0);
}

#[test]
fn a_member_serving_another_model_is_refused() {
    let a = start("a", &[]);
    let b = start("b", &[a.local_addr()]);
    let other = Membership::start(config(
        "other",
        any_port(),
        &[a.local_addr()],
        "secret",
        0xbad,
    ))
    .expect("starts");
    assert!(wait_for(Duration::from_secs(3) + SLACK, || all_alive(&[&a, &b], 2)).is_some());
    std::thread::sleep(PROBE * 5);
    for membership in [&a, &b] {
        assert!(
            state_of(membership, "other").is_none(),
            "{:?}",
            membership.members()
        );
    }
    assert!(a.stats().members_refused.load(Ordering::Relaxed) > 0);
    assert_eq!(a.stats().packets_rejected.total(), 0);
    // Its announces are dropped unanswered: it stays alone.
    assert_eq!(other.members().len(), 1);
}

#[test]
fn garbage_datagrams_are_rejected_and_membership_holds() {
    let a = start("a", &[]);
    let b = start("b", &[a.local_addr()]);
    assert!(wait_for(Duration::from_secs(3) + SLACK, || all_alive(&[&a, &b], 2)).is_some());
    let sender = UdpSocket::bind(any_port()).expect("binds");
    let oversized = vec![0x5au8; 4000];
    let mut sent = 0u64;
    for datagram in [
        &b""[..],
        &b"x"[..],
        &[0u8; 27][..],
        &[0xffu8; 28][..],
        &[7u8; 1400][..],
        &oversized[..],
    ] {
        sender.send_to(datagram, a.local_addr()).expect("sends");
        sent += 1;
    }
    let rejected = wait_for(Duration::from_secs(2), || {
        a.stats().packets_rejected.total() >= sent
    });
    assert!(
        rejected.is_some(),
        "rejected {}",
        a.stats().packets_rejected.total()
    );
    std::thread::sleep(PROBE * 5);
    assert!(all_alive(&[&a, &b], 2));
}

#[test]
fn a_new_placement_version_reaches_every_member_without_a_death() {
    let (a, b, c) = three();
    let mut changes = b.changes();
    changes.mark_unchanged();
    a.set_serving(TableId {
        version: 42,
        hash: 9,
    });
    let seen = wait_for(Duration::from_secs(2) + SLACK, || {
        [&b, &c].iter().all(|observer| {
            observer
                .members()
                .iter()
                .any(|view| view.meta.node == "a" && view.meta.placement_version == 42)
        })
    });
    assert!(seen.is_some(), "{:?}", b.members());
    assert_eq!(a.members()[0].meta.placement_version, 42);
    assert!(changes.has_changed().unwrap_or(false));
    std::thread::sleep(PROBE * 5);
    assert!(all_alive(&[&a, &b, &c], 3));
    for membership in [&a, &b, &c] {
        assert_eq!(
            membership.stats().transitions.dead.load(Ordering::Relaxed),
            0
        );
    }
}

#[test]
fn bad_configs_are_refused_before_binding() {
    let mut no_key = config("a", any_port(), &[], "k", MODEL);
    no_key.keys.clear();
    assert!(matches!(
        Membership::start(no_key),
        Err(super::MembershipError::NoKey)
    ));
    let long = config(&"n".repeat(65), any_port(), &[], "k", MODEL);
    assert!(matches!(
        Membership::start(long),
        Err(super::MembershipError::NodeIdTooLong { len: 65 })
    ));
    let taken = start("a", &[]);
    let clash = config("b", taken.local_addr(), &[], "k", MODEL);
    assert!(matches!(
        Membership::start(clash),
        Err(super::MembershipError::Bind { .. })
    ));
}

/// Two members that change their versions at the same moment (both switch once the other
/// has loaded) each address their gossip to the other's old identity, which the other no
/// longer accepts. Both must still learn the other's new versions.
#[test]
fn two_members_changing_versions_at_once_both_learn_the_other_s() {
    let a = start("a", &[]);
    let b = start("b", &[a.local_addr()]);
    assert!(
        wait_for(Duration::from_secs(5) + SLACK, || all_alive(&[&a, &b], 2)).is_some(),
        "{:?}",
        a.members()
    );
    let version_of = |observer: &Membership, node: &str| {
        observer
            .members()
            .into_iter()
            .find(|view| {
                view.meta.node == node && !view.is_self && view.state == MemberState::Alive
            })
            .map(|view| (view.meta.placement_version, view.meta.loaded_hash / 3))
    };
    for round in 2..12u64 {
        let id = |version| TableId {
            version,
            hash: version * 3,
        };
        a.set_versions(id(round - 1), id(round));
        b.set_versions(id(round - 1), id(round));
        a.set_versions(id(round), id(round));
        b.set_versions(id(round), id(round));
        let seen = wait_for(PROBE * 10 + SLACK, || {
            version_of(&a, "b") == Some((round, round))
                && version_of(&b, "a") == Some((round, round))
        });
        assert!(
            seen.is_some(),
            "round {round}: a sees b at {:?}, b sees a at {:?}",
            version_of(&a, "b"),
            version_of(&b, "a")
        );
    }
}

/// A UDP relay in front of a member: it stands at the address the member advertises,
/// forwards what arrives to the member's socket and keeps a copy; told to replay, it
/// forwards nothing more and sends its copies to the member again, round after round.
struct Relay {
    captured: Arc<Mutex<Vec<Vec<u8>>>>,
    replaying: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn start(front: SocketAddr, member: SocketAddr) -> Relay {
        let socket = UdpSocket::bind(front).expect("the relay binds");
        socket
            .set_read_timeout(Some(Duration::from_millis(5)))
            .expect("timeout");
        let relay = Relay {
            captured: Arc::default(),
            replaying: Arc::default(),
            stop: Arc::default(),
        };
        let (captured, replaying, stop) = (
            relay.captured.clone(),
            relay.replaying.clone(),
            relay.stop.clone(),
        );
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            let mut next = 0usize;
            while !stop.load(Ordering::Relaxed) {
                if replaying.load(Ordering::Relaxed) {
                    let copy = {
                        let captured = captured.lock().expect("lock");
                        next = (next + 1) % captured.len().max(1);
                        captured.get(next).cloned()
                    };
                    if let Some(datagram) = copy {
                        let _ = socket.send_to(&datagram, member);
                    }
                    std::thread::sleep(Duration::from_micros(500));
                    continue;
                }
                if let Ok((len, _)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(&buf[..len], member);
                    captured.lock().expect("lock").push(buf[..len].to_vec());
                }
            }
        });
        relay
    }

    fn captured(&self) -> usize {
        self.captured.lock().expect("lock").len()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[test]
fn a_dead_members_replayed_datagrams_are_refused_and_it_is_declared_dead_on_time() {
    let (probe, suspicion) = (Duration::from_millis(40), Duration::from_millis(600));
    let fast = |mut config: MembershipConfig| {
        config.probe_period = probe;
        config.suspicion_timeout = suspicion;
        config
    };
    // `a` advertises 127.0.0.2 with its port: b reaches it through the relay there.
    let mut a_config = fast(config("a", any_port(), &[], "secret", MODEL));
    a_config.advertise_host = Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)));
    let a = Membership::start(a_config).expect("starts");
    let front = SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)),
        a.local_addr().port(),
    );
    let relay = Relay::start(front, a.local_addr());
    let b = Membership::start(fast(config("b", any_port(), &[front], "secret", MODEL)))
        .expect("starts");
    assert!(wait_for(Duration::from_secs(3) + SLACK, || all_alive(&[&a, &b], 2)).is_some());
    // Past 256 of a's probes: foca's probe numbers are 8 bits, so b's captured acks would
    // answer any probe a sends next.
    std::thread::sleep(probe * 300);
    assert!(relay.captured() > 300, "captured {}", relay.captured());
    b.halt();
    relay.replaying.store(true, Ordering::Relaxed);
    let took = wait_for(probe * 2 + suspicion + SLACK, || {
        state_of(&a, "b") == Some(MemberState::Dead)
    });
    let replays = a.stats().packets_rejected.replay.load(Ordering::Relaxed);
    assert!(
        took.is_some(),
        "b stayed {:?} on a while its datagrams were replayed ({replays} refused)",
        state_of(&a, "b")
    );
    assert!(replays > 100, "only {replays} replays refused");
}

#[test]
fn a_secret_removed_by_a_reload_is_refused_at_once() {
    // a seals with "new", b with "old"; each opens both.
    let mut a_config = config("a", any_port(), &[], "new-secret", MODEL);
    a_config.keys.push("old-secret".into());
    let a = Membership::start(a_config).expect("starts");
    let mut b_config = config("b", any_port(), &[a.local_addr()], "old-secret", MODEL);
    b_config.keys.push("new-secret".into());
    let b = Membership::start(b_config).expect("starts");
    assert!(wait_for(Duration::from_secs(3) + SLACK, || all_alive(&[&a, &b], 2)).is_some());
    assert_eq!(a.stats().packets_rejected.total(), 0);
    a.set_keys(&["new-secret".to_string()]).expect("a secret");
    let refused = wait_for(PROBE * 2 + SLACK, || {
        a.stats()
            .packets_rejected
            .unauthenticated
            .load(Ordering::Relaxed)
            > 0
    });
    assert!(
        refused.is_some(),
        "b's old-secret datagrams still open on a"
    );
    let took = wait_for(PROBE * 2 + SUSPICION + SLACK, || {
        state_of(&a, "b") == Some(MemberState::Dead)
    });
    assert!(took.is_some(), "a sees b {:?}", state_of(&a, "b"));
    assert!(a.set_keys(&[]).is_err(), "no secret is refused");
}
