use super::*;

const MS: Duration = Duration::from_millis(1);

fn policy(may_wait: bool) -> Policy {
    Policy {
        may_wait,
        wait_for: 100 * MS,
        give_up: 1000 * MS,
    }
}

/// Every pending group to `target`, as the driver would choose.
fn all_to(attempts: &Attempts<u32>, target: Target) -> Vec<Option<Target>> {
    attempts.pending().iter().map(|_| Some(target)).collect()
}

#[test]
fn groups_go_out_grouped_by_target_and_come_back_in_order() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[7, 8, 9], &[1, 2, 3], policy(false));
    let choices = [
        Some(Target::Node(1)),
        Some(Target::Device(0)),
        Some(Target::Node(1)),
    ];
    let sends = a.place(&choices, t0).unwrap();
    assert_eq!(
        sends,
        [(Target::Device(0), vec![1]), (Target::Node(1), vec![0, 2])]
    );
    assert!(a.pending().is_empty());
    let device = a.started(Target::Device(0), vec![1], false, t0);
    let node = a.started(Target::Node(1), vec![0, 2], false, t0);
    assert_eq!(a.send(node).rows, 4);
    match a.answered(node, Ok(vec![70, 90]), t0 + 5 * MS) {
        Answered::Delivered {
            new_groups,
            late,
            sample,
            ..
        } => {
            assert_eq!(new_groups, [0, 2]);
            assert_eq!(late, 0);
            assert_eq!(sample, Some(5 * MS));
        }
        other => panic!("{other:?}"),
    }
    assert!(!a.is_done());
    a.answered(device, Ok(vec![80]), t0 + 6 * MS);
    assert!(a.is_done());
    assert_eq!(a.take_outputs(), [70, 80, 90]);
    assert_eq!(a.unanswered().count(), 0);
}

#[test]
fn a_failed_target_is_excluded_and_its_groups_are_placed_again() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[3, 4], &[1, 1], policy(false));
    a.place(&all_to(&a, Target::Node(1)), t0).unwrap();
    let id = a.started(Target::Node(1), vec![0, 1], false, t0);
    match a.answered(
        id,
        Err(TargetError::Gone(GoneCause::DroppedUnanswered)),
        t0 + MS,
    ) {
        Answered::Failed { failovers, .. } => assert_eq!(failovers, 2),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.pending(), [0, 1]);
    assert!(a.excluded(0, Target::Node(1)));
    assert!(!a.excluded(0, Target::Node(2)));
    // A wrong number of outputs is a failure too.
    a.place(&all_to(&a, Target::Node(2)), t0).unwrap();
    let id = a.started(Target::Node(2), vec![0, 1], false, t0);
    assert!(matches!(
        a.answered(id, Ok(vec![1]), t0 + MS),
        Answered::Failed { failovers: 2, .. }
    ));
    // Nothing left for them: the dispatch fails, naming each expert once, sorted.
    assert_eq!(a.place(&[None, None], t0), Err(NoReplica(vec![3, 4])));
}

#[test]
fn a_late_node_is_hedged_once_and_the_first_answer_wins() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[5], &[2], policy(false));
    a.place(&all_to(&a, Target::Node(1)), t0).unwrap();
    let slow = a.started(Target::Node(1), vec![0], false, t0);
    let deadline = |_: Target| 10 * MS;
    assert_eq!(a.next_wait(t0 + 4 * MS, deadline), 6 * MS);
    assert!(a.tick(t0 + 9 * MS, deadline).is_empty());
    let overdue = a.tick(t0 + 10 * MS, deadline);
    assert!(matches!(overdue[..], [Overdue::Hedged { hedges: 1, .. }]));
    assert_eq!(a.pending(), [0]);
    assert!(a.excluded(0, Target::Node(1)));
    // Hedged once: the next look waits for give-up, not the deadline again.
    assert!(a.tick(t0 + 20 * MS, deadline).is_empty());
    assert_eq!(a.next_wait(t0 + 20 * MS, deadline), 980 * MS);
    a.place(&all_to(&a, Target::Node(2)), t0 + 20 * MS).unwrap();
    let fast = a.started(Target::Node(2), vec![0], false, t0 + 20 * MS);
    assert!(matches!(
        a.answered(fast, Ok(vec![1]), t0 + 21 * MS),
        Answered::Delivered { ref new_groups, .. } if new_groups == &[0]
    ));
    // The slow one answers later: counted late, its time not taken as a latency sample.
    match a.answered(slow, Ok(vec![2]), t0 + 30 * MS) {
        Answered::Delivered {
            new_groups,
            late,
            sample,
            ..
        } => {
            assert!(new_groups.is_empty());
            assert_eq!(late, 1);
            assert_eq!(sample, None);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.take_outputs(), [1]);
}

#[test]
fn a_node_silent_past_give_up_fails_its_groups_and_a_later_answer_is_stale() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[1, 2], &[1, 1], policy(false));
    a.place(&all_to(&a, Target::Node(3)), t0).unwrap();
    let id = a.started(Target::Node(3), vec![0, 1], false, t0);
    let never = |_: Target| Duration::from_secs(60);
    match &a.tick(t0 + 1000 * MS, never)[..] {
        [
            Overdue::GaveUp {
                failovers, error, ..
            },
        ] => {
            assert_eq!(*failovers, 2);
            assert!(matches!(error, TargetError::Gone(_)));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.pending(), [0, 1]);
    assert!(matches!(
        a.answered(id, Ok(vec![1, 2]), t0),
        Answered::Stale
    ));
    assert!(!a.is_done());
}

#[test]
fn local_devices_have_no_deadline() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[1], &[1], policy(false));
    a.place(&all_to(&a, Target::Device(0)), t0).unwrap();
    a.started(Target::Device(0), vec![0], false, t0);
    assert!(a.tick(t0 + Duration::from_secs(3600), |_| MS).is_empty());
    assert_eq!(a.unanswered().collect::<Vec<_>>(), [(Target::Device(0), 1)]);
}

#[test]
fn a_group_still_covered_waits_for_its_send_rather_than_failing() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[1], &[1], policy(false));
    a.place(&all_to(&a, Target::Node(1)), t0).unwrap();
    a.started(Target::Node(1), vec![0], false, t0);
    a.tick(t0 + 10 * MS, |_| MS);
    // Hedged, but no other target: it keeps waiting for the slow one.
    assert_eq!(a.place(&[None], t0 + 10 * MS), Ok(vec![]));
    assert!(a.pending().is_empty());
}

#[test]
fn under_the_wait_policy_a_group_waits_then_fails() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[4], &[1], policy(true));
    a.place(&all_to(&a, Target::Node(1)), t0).unwrap();
    let id = a.started(Target::Node(1), vec![0], false, t0);
    a.answered(id, Err(TargetError::Failed(FailCause::WrongReply)), t0);
    assert!(a.excluded(0, Target::Node(1)));
    // No target now: it waits, and the failed target may be tried again.
    assert_eq!(a.place(&[None], t0 + MS), Ok(vec![]));
    assert_eq!(a.pending(), [0]);
    assert!(!a.excluded(0, Target::Node(1)));
    assert_eq!(a.place(&[None], t0 + 50 * MS), Ok(vec![]));
    // `wait_for` after the first miss, it fails.
    assert_eq!(a.place(&[None], t0 + 101 * MS), Err(NoReplica(vec![4])));
}

#[test]
fn a_cold_send_gives_no_latency_sample() {
    let t0 = Instant::now();
    let mut a: Attempts<u32> = Attempts::new(&[1], &[1], policy(false));
    a.place(&all_to(&a, Target::Node(1)), t0).unwrap();
    let id = a.started(Target::Node(1), vec![0], true, t0);
    assert!(matches!(
        a.answered(id, Ok(vec![1]), t0 + 40 * MS),
        Answered::Delivered { sample: None, took, .. } if took == 40 * MS
    ));
}
