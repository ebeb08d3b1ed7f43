use dataplane::nft::desired::Before;
use dataplane::nft::plan::plan;
use dataplane::nft::ruleset::Family;

use super::cases::{cases, setup};
use super::*;

/// A fake holding [`setup`]'s table.
fn prepared(family: Family) -> FakeKernel {
    let fake = FakeKernel::new();
    fake.commit(&setup(family)).expect("the setup commits");
    fake
}

#[test]
fn refuses_what_the_kernel_refuses_and_nothing_else() {
    for family in Family::ALL {
        for case in cases(family) {
            let fake = prepared(family);
            let before = fake.render(family);
            let got = fake.commit(&case.tx);
            match (case.refused, &got) {
                (None, Ok(())) => {}
                (Some((index, errno)), Err(e)) => {
                    assert_eq!(e.op_index(), Some(index), "{}: {e}", case.name);
                    assert_eq!(e.errno(), Some(errno), "{}: {e}", case.name);
                    assert!(e.refused_op().is_some(), "{}", case.name);
                    assert_eq!(fake.render(family), before, "{}: not atomic", case.name);
                }
                (want, got) => panic!("{}: expected {want:?}, got {got:?}", case.name),
            }
            let log = fake.transactions();
            assert_eq!(log.len(), 2, "{}", case.name);
            assert_eq!(log[1].tx, case.tx);
            assert_eq!(log[1].refused, case.refused.map(|(_, errno)| errno));
        }
    }
}

#[test]
fn keeps_what_exists_when_it_is_added_again() {
    let family = Family::V4;
    let fake = prepared(family);
    let before = fake.render(family);
    let again = cases(family)
        .into_iter()
        .find(|c| c.name == "re-adding what exists, with the same data")
        .expect("the case exists");
    fake.commit(&again.tx).expect("accepted");
    // The first comment stays, as in the kernel; nothing else changed either.
    assert_eq!(fake.render(family), before);
}

#[test]
fn a_plan_applied_renders_the_desired_table_and_reads_back_as_planned() {
    let family = Family::V6;
    let fake = prepared(family);
    let mut kernel = fake.clone();
    let current = kernel.read_table(family).unwrap().expect("a table");
    let mut desired = fake.table(family).unwrap();
    desired.chains.remove("c");
    desired.sets.get_mut("m").unwrap().elements_mut().clear();
    let tx = plan(Some(&current), &Before::Nothing, &desired);
    kernel.apply(&tx).expect("the plan commits");
    let mut state = current;
    state.settle();
    state.apply(&tx);
    let cleanup = dataplane::nft::plan::plan_cleanup(&state, &desired);
    kernel.apply(&cleanup).expect("the cleanup commits");
    state.apply(&cleanup);
    assert_eq!(fake.render(family), render::table_text(&desired));
    let read = kernel.read_table(family).unwrap().expect("a table");
    assert_eq!(read, table_state(&desired));
    assert!(state.agrees_with(&read, &desired));
    // The other family has no table.
    assert_eq!(kernel.read_table(Family::V4).unwrap(), None);
    assert_eq!(fake.render(Family::V4), "");
}

#[test]
fn a_broken_family_fails_while_the_other_works() {
    let fake = prepared(Family::V4);
    let mut kernel = fake.clone();
    fake.break_family(Family::V4, Some(libc::EIO));
    assert!(kernel.read_table(Family::V4).is_err());
    let err = kernel.apply(&setup(Family::V4)).expect_err("broken");
    assert_eq!(err.errno(), Some(libc::EIO));
    kernel
        .apply(&setup(Family::V6))
        .expect("the other family works");
    fake.break_family(Family::V4, None);
    assert!(kernel.read_table(Family::V4).unwrap().is_some());
    assert_eq!(fake.reads(), 2);
}

#[test]
fn apply_all_stops_at_the_first_refused_part() {
    let family = Family::V4;
    let fake = prepared(family);
    let mut kernel = fake.clone();
    let all = cases(family);
    let good = all.iter().find(|c| c.refused.is_none()).unwrap().tx.clone();
    let bad = all.iter().find(|c| c.refused.is_some()).unwrap().tx.clone();
    let mut committed = 0;
    let err = kernel
        .apply_all(vec![good, bad, setup(family)], &mut |_| committed += 1)
        .expect_err("the second part is refused");
    assert_eq!(committed, 1);
    assert_eq!(err.op_index(), Some(0));
    assert_eq!(fake.transactions().len(), 3);
}
