use super::*;
use hybridgen_dsl::{ModelConfig, Plan, PlanOptions};

fn plan(pattern: &str) -> Plan {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    Plan::new(&model, &PlanOptions::default()).unwrap()
}

#[test]
fn forward_only_programs_run_every_forward_slot_and_nothing_else() {
    for pattern in ["M[*E]M-[*E]", "M*-/*E", "[M*]"] {
        let plan = plan(pattern);
        let program = build_forward_only(&plan, 0, 3);
        let instrs: Vec<Instr> = program.instrs().collect();
        let mut refs = vec![0isize; plan.units.len()];
        for mb in 0..3 {
            let forwards: Vec<(usize, Slot)> = instrs
                .iter()
                .filter_map(|x| match *x {
                    Instr::Forward { mb: m, node, slot } if m == mb => Some((node, slot)),
                    _ => None,
                })
                .collect();
            let expected: Vec<(usize, Slot)> = plan
                .schedule
                .nodes
                .iter()
                .enumerate()
                .flat_map(|(i, n)| NodeShape::of(n).forward_slots().map(move |s| (i, s)))
                .collect();
            assert_eq!(forwards, expected, "{pattern} mb {mb}");
            let retire = instrs.iter().position(|x| *x == Instr::Retire { mb });
            let last = instrs
                .iter()
                .rposition(|x| matches!(x, Instr::Forward { mb: m, .. } if *m == mb));
            assert!(last < retire, "{pattern} mb {mb}");
        }
        for instr in &instrs {
            match *instr {
                Instr::Acquire { unit } => refs[unit] += 1,
                Instr::Release { unit } => {
                    refs[unit] -= 1;
                    assert!(refs[unit] >= 0, "{pattern}: released twice");
                }
                Instr::Forward { node, .. } => {
                    if let Some(u) = plan.schedule.nodes[node].unit {
                        assert!(refs[u] > 0, "{pattern}: unit {u} not acquired");
                    }
                }
                Instr::Retire { .. } => {}
                other => panic!("{pattern}: a forward-only program has {other:?}"),
            }
        }
        assert!(refs.iter().all(|&r| r == 0), "{pattern}: {refs:?}");
        assert_eq!(program.max_grad_buffers, 0);
        assert_eq!(program.in_flight(), 1);
    }
}

/// Every micro-batch runs every non-empty slot and piece exactly once,
/// forward before backward, whatever the schedule.
fn check_complete(plan: &Plan, program: &Program, micro_batches: usize) {
    let instrs: Vec<Instr> = program.instrs().collect();
    assert_eq!(instrs.len(), program.len());
    for mb in 0..micro_batches {
        for (i, node) in plan.schedule.nodes.iter().enumerate() {
            let shape = NodeShape::of(node);
            for slot in shape.forward_slots() {
                let n = instrs
                    .iter()
                    .filter(|&&x| x == Instr::Forward { mb, node: i, slot })
                    .count();
                assert_eq!(n, 1, "mb {mb} node {i} {slot:?}");
            }
        }
        let first_bwd = instrs
            .iter()
            .position(|x| matches!(x, Instr::Backward { mb: m, .. } if *m == mb));
        let last_fwd = instrs
            .iter()
            .rposition(|x| matches!(x, Instr::Forward { mb: m, .. } if *m == mb));
        assert!(
            last_fwd < first_bwd,
            "mb {mb}: backward before forward ended"
        );
        // Retired once, after its last piece of work.
        let retired: Vec<usize> = (0..instrs.len())
            .filter(|&i| instrs[i] == Instr::Retire { mb })
            .collect();
        assert_eq!(retired.len(), 1, "mb {mb} retired {retired:?}");
        let last_work = instrs.iter().rposition(|x| {
            !matches!(x, Instr::Retire { .. }) && x.micro_batches().any(|m| m == mb)
        });
        assert!(last_work < Some(retired[0]), "mb {mb} works after retiring");
    }
    // References balance, work only touches acquired units, and every
    // unit gets one gradient buffer and one reduce per micro-batch.
    let mut refs = vec![0usize; plan.units.len()];
    let mut grads = vec![0usize; plan.units.len()];
    for instr in &instrs {
        match *instr {
            Instr::Acquire { unit } => refs[unit] += 1,
            Instr::Release { unit } => {
                assert!(refs[unit] > 0, "release of unit {unit} without acquire");
                refs[unit] -= 1;
            }
            Instr::GradBuffer { unit } => {
                assert!(refs[unit] > 0, "gradient buffer for unresident unit {unit}");
                grads[unit] += 1;
            }
            Instr::Reduce { unit, .. } => {
                assert!(
                    grads[unit] > 0,
                    "reduce of unit {unit} without gradient buffer"
                );
                grads[unit] -= 1;
            }
            Instr::Retire { .. } | Instr::Exchange { .. } => {}
            Instr::Forward { node, .. } | Instr::Backward { node, .. } => {
                if let Some(unit) = plan.schedule.nodes[node].unit {
                    assert!(
                        refs[unit] > 0,
                        "node {node} runs with unit {unit} not acquired"
                    );
                }
            }
        }
    }
    assert!(
        refs.iter().all(|&r| r == 0),
        "unbalanced references {refs:?}"
    );
    assert!(
        grads.iter().all(|&g| g == 0),
        "gradient buffers left {grads:?}"
    );
    let reduces = instrs
        .iter()
        .filter(|x| matches!(x, Instr::Reduce { .. }))
        .count();
    assert_eq!(reduces, plan.units.len() * micro_batches);
}

#[test]
fn both_schedules_run_everything_once() {
    for pattern in ["[*E][*E]", "M[*E]M-[*E]", "[M*E][M*E]/*E", "M-"] {
        let plan = plan(pattern);
        for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            for n in [1, 2, 4] {
                let program = build(&plan, 0, n, kind).unwrap();
                check_complete(&plan, &program, n);
            }
        }
    }
}

/// Every kind-list filter over patterns whose unit-less layers sit
/// between units (and at the ends, and in MTP depths): both schedules
/// build, pass [`Program::check`] and run everything once, and a unit
/// prefetched across unit-less layers is gathered once, not twice.
#[test]
fn every_kind_filter_builds_with_layers_between_units() {
    use hybridgen_dsl::LayerKind;
    use hybridgen_dsl::plan::{UnitFilter, UnitKind};
    let kinds = [
        UnitKind::Group,
        UnitKind::Mtp,
        UnitKind::Layer(LayerKind::Mamba),
        UnitKind::Layer(LayerKind::Attention),
        UnitKind::Layer(LayerKind::Mlp),
        UnitKind::Layer(LayerKind::Moe),
    ];
    for pattern in ["[*E]M[*E]", "M[*E]M[*E]", "M[*E]M-M[*E]/*E", "-M*[ME]-*"] {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = pattern.to_string();
        for subset in 0u32..1 << kinds.len() {
            let chosen: Vec<UnitKind> = (0..kinds.len())
                .filter(|&k| subset & (1 << k) != 0)
                .map(|k| kinds[k])
                .collect();
            let options = PlanOptions {
                unit_filter: UnitFilter::kinds(&chosen),
                ..PlanOptions::default()
            };
            let plan = Plan::new(&model, &options).unwrap();
            for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
                for n in [1, 2, 3] {
                    let program = build(&plan, 0, n, kind)
                        .unwrap_or_else(|e| panic!("{pattern} {chosen:?} {kind:?} {n}: {e}"));
                    check_complete(&plan, &program, n);
                    // The plain schedule's forward gathers each unit once
                    // a micro-batch, whatever lies between the units.
                    if kind == ScheduleKind::Plain {
                        let acquires = program
                            .instrs()
                            .filter(|x| matches!(x, Instr::Acquire { .. }))
                            .count();
                        assert_eq!(
                            acquires,
                            2 * plan.units.len() * n,
                            "{pattern} {chosen:?}: one acquire a unit forward and one backward"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn overlap_interleaves_forward_and_backward_as_the_spec_orders() {
    let plan = plan("[*E][*E]");
    let program = build(&plan, 0, 2, ScheduleKind::Overlap).unwrap();
    let work: Vec<String> = program
        .instrs()
        .filter_map(|x| match x {
            Instr::Forward { mb: 1, node, slot } => Some(format!("f{node} {}", slot.name())),
            Instr::Backward { mb: 0, node, piece } => Some(format!("b{node} {}", piece.name())),
            _ => None,
        })
        .collect();
    // Node 0 forward (mb 1) paired with node 1 backward (mb 0), then
    // node 1 forward with node 0 backward. Node 1 holds the head.
    let expected = [
        "b1 post-process bwd",
        "b1 combine bwd",
        "f0 pre-dispatch",
        "b1 mlp bwd",
        "f0 dispatch",
        "b1 mlp wgrad",
        "b1 dispatch bwd",
        "f0 mlp",
        "f0 combine",
        "b1 pre-dispatch bwd",
        "b1 pre-dispatch wgrad",
        "b0 combine bwd",
        "f1 pre-dispatch",
        "b0 mlp bwd",
        "f1 dispatch",
        "b0 mlp wgrad",
        "b0 dispatch bwd",
        "f1 mlp",
        "f1 combine",
        "b0 pre-dispatch bwd",
        "f1 mtp post-process",
        "b0 pre-dispatch wgrad",
    ];
    assert_eq!(work, expected);
}

/// The issue order as it was built before programs were stored in
/// blocks: every micro-batch's instructions one after another.
fn built_in_full(plan: &Plan, n: usize, kind: ScheduleKind) -> (Vec<Instr>, usize, usize) {
    let nodes = &plan.schedule.nodes;
    let mut b = ProgramBuilder::new(
        nodes.iter().map(|n| n.unit).collect(),
        nodes.iter().map(NodeShape::of).collect(),
    );
    let all = 0..nodes.len();
    let backward_all = |b: &mut ProgramBuilder, mb: usize| {
        b.backward_pass(mb, all.clone());
        b.instrs.push(Instr::Retire { mb });
    };
    match kind {
        ScheduleKind::Plain => {
            for mb in 0..n {
                b.forward_pass(mb, all.clone());
                backward_all(&mut b, mb);
            }
        }
        ScheduleKind::Overlap => {
            b.forward_pass(0, all.clone());
            for k in 1..n {
                b.combined(k, all.clone(), k - 1, all.clone());
                b.instrs.push(Instr::Retire { mb: k - 1 });
            }
            backward_all(&mut b, n - 1);
        }
    }
    (b.instrs, b.max_resident, b.max_grads)
}

#[test]
fn blocks_expand_to_the_full_issue_order_and_stay_small() {
    for pattern in ["[*E][*E]", "M[*E]M-[*E]", "[M*E][M*E]/*E"] {
        let plan = plan(pattern);
        for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            for n in 1..6 {
                let program = build(&plan, 0, n, kind).unwrap();
                let (full, resident, grads) = built_in_full(&plan, n, kind);
                assert_eq!(
                    program.instrs().collect::<Vec<_>>(),
                    full,
                    "{pattern} {kind:?} {n}"
                );
                assert_eq!(program.max_resident_units, resident);
                assert_eq!(program.max_grad_buffers, grads);
                let live = if kind == ScheduleKind::Overlap {
                    n.min(2)
                } else {
                    1
                };
                assert_eq!(program.max_live_micro_batches, live, "{kind:?} {n}");
            }
            // A million micro-batches: the stored program is the size of
            // three's.
            let small = build(&plan, 0, 3, kind).unwrap();
            let huge = build(&plan, 0, 1_000_000, kind).unwrap();
            assert_eq!(huge.stored_len(), small.stored_len());
            assert!(huge.len() > 1_000_000 * (small.len() / 4), "{}", huge.len());
            let many = build(&plan, 0, 10_000, kind).unwrap();
            assert_eq!(many.instrs().last(), Some(Instr::Retire { mb: 9_999 }));
        }
    }
}

/// A program of every instruction of `good`, edited.
fn edited(good: &Program, edit: impl FnOnce(&mut Vec<Instr>)) -> Program {
    let mut instrs: Vec<Instr> = good.instrs().collect();
    edit(&mut instrs);
    Program {
        blocks: vec![Block {
            instrs,
            first: 0,
            repeats: 1,
        }],
        ..good.clone()
    }
}

#[test]
fn out_of_order_programs_are_refused() {
    let plan = plan("M[*E]-");
    let good = build(&plan, 0, 2, ScheduleKind::Overlap).unwrap();
    assert_eq!(good.check(&plan.schedule), Ok(()));
    let work: Vec<usize> = good
        .instrs()
        .enumerate()
        .filter(|(_, x)| matches!(x, Instr::Backward { mb: 0, .. }))
        .map(|(i, _)| i)
        .collect();
    // Two backward pieces of one micro-batch swapped.
    let swapped = edited(&good, |i| i.swap(work[0], work[1]));
    let err = swapped.check(&plan.schedule).unwrap_err();
    assert!(err.contains("micro-batch 0 expected"), "{err}");
    // Refused as hybridgen's own bug, not the configuration's.
    let refused = checked(&swapped, &plan.schedule).unwrap_err();
    assert_eq!(refused.code(), "internal");
    assert!(
        refused.to_string().contains("a bug in hybridgen"),
        "{refused}"
    );
    // A piece dropped: the one after it is out of order.
    let dropped = edited(&good, |i| {
        i.remove(work[2]);
    });
    let err = dropped.check(&plan.schedule).unwrap_err();
    assert!(err.contains("micro-batch 0 expected"), "{err}");
    // The last piece dropped: the retirement comes with work left.
    let dropped = edited(&good, |i| {
        i.remove(*work.last().unwrap());
    });
    let err = dropped.check(&plan.schedule).unwrap_err();
    assert!(err.contains("work left"), "{err}");
    // Work on a unit that was released.
    let released = edited(&good, |i| {
        let unit = i
            .iter()
            .find_map(|x| match x {
                Instr::Release { unit } => Some(*unit),
                _ => None,
            })
            .unwrap();
        i.insert(0, Instr::Release { unit });
    });
    assert!(
        released
            .check(&plan.schedule)
            .unwrap_err()
            .contains("not acquired")
    );
    // Work after the retirement.
    let late = edited(&good, |i| {
        let retire = i
            .iter()
            .position(|x| *x == Instr::Retire { mb: 0 })
            .unwrap();
        let last = i[..retire]
            .iter()
            .rposition(|x| matches!(x, Instr::Backward { mb: 0, .. }))
            .unwrap();
        let piece = i.remove(last);
        i.insert(retire, piece);
    });
    assert!(late.check(&plan.schedule).is_err());
}

#[test]
fn pool_needs_are_bounded() {
    let plan = plan("[*E][*E][*E][*E][*E][*E]");
    let plain = build(&plan, 0, 4, ScheduleKind::Plain).unwrap();
    let overlap = build(&plan, 0, 4, ScheduleKind::Overlap).unwrap();
    // A unit and its prefetch; the overlap schedule runs a forward and a
    // backward unit, each with its prefetch.
    assert!(
        plain.max_resident_units <= 2,
        "{}",
        plain.max_resident_units
    );
    assert!(
        overlap.max_resident_units <= 4,
        "{}",
        overlap.max_resident_units
    );
    assert_eq!(plain.max_grad_buffers, 1);
    assert!(overlap.max_grad_buffers <= 2);
}
