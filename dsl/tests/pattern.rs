//! The pattern language against docs/pattern-language.md: every rule's code at
//! its exact line:column, Megatron's own examples, sugar, counts, canonical
//! printing and the terminal rendering of errors.
//!
//! Expected positions are worked out by hand from the spec (which character
//! is the culprit), not copied from the implementation.

use hybridgen_dsl::{Code, LayerKind, Pattern};

/// `(code, "line:column")` of every diagnostic of `source`, in report order.
fn errors(source: &str) -> Vec<(Code, String)> {
    match Pattern::parse(source) {
        Ok(p) => panic!("{source:?} parsed as {p}, expected errors"),
        Err(d) => d
            .positions()
            .into_iter()
            .map(|(code, at)| {
                let at = at.unwrap_or_else(|| panic!("{source:?}: {code} has no position"));
                (code, at.to_string())
            })
            .collect(),
    }
}

fn parse(source: &str) -> Pattern {
    Pattern::parse(source).unwrap_or_else(|d| panic!("{source:?} should parse:\n{d}"))
}

/// Checks each `(source, [(code, "line:col"), ...])`.
fn check(cases: &[(&str, &[(Code, &str)])]) {
    for (source, expected) in cases {
        let expected: Vec<(Code, String)> = expected
            .iter()
            .map(|&(c, at)| (c, at.to_string()))
            .collect();
        assert_eq!(errors(source), expected, "pattern {source:?}");
    }
}

/// The help line of the only diagnostic of `source`.
fn help(source: &str) -> String {
    let d = Pattern::parse(source).unwrap_err();
    assert_eq!(d.items.len(), 1, "{source:?}: {d}");
    d.items[0].help.clone()
}

// ---- Megatron's examples (pattern.md) -------------------------------------

#[test]
fn megatron_examples_parse_to_the_same_layers() {
    let p = parse("M*M*");
    assert_eq!((p.physical_count(), p.logical_count()), (4, 4));

    // `M[M*]-`: 4 physical, 3 logical.
    let p = parse("M[M*]-");
    assert_eq!((p.physical_count(), p.logical_count()), (4, 3));
    assert_eq!(p.mtp_depth_count(), 0);
    let kinds: Vec<LayerKind> = p.layers().map(|l| l.kind).collect();
    assert_eq!(
        kinds,
        [
            LayerKind::Mamba,
            LayerKind::Mamba,
            LayerKind::Attention,
            LayerKind::Mlp
        ]
    );
    assert!(p.items().nth(1).unwrap().is_group());

    // `[M*E]` is one group: one logical layer of three physical ones.
    let p = parse("[M*E]");
    assert_eq!((p.physical_count(), p.logical_count()), (3, 1));

    // `[*E][*E]|[*E][*E]`: two segments.
    let p = parse("[*E][*E]|[*E][*E]");
    assert_eq!(p.segments.len(), 2);
    assert_eq!((p.physical_count(), p.logical_count()), (8, 4));
    assert!(p.has_pipeline_segments());

    // `[M*E][M*E]/*E`: two groups, one MTP depth.
    let p = parse("[M*E][M*E]/*E");
    assert_eq!(
        (p.physical_count(), p.logical_count(), p.mtp_depth_count()),
        (6, 2, 1)
    );
    assert_eq!(p.mtp_depths[0].layers.len(), 2);

    // `/MM/MM`: no decoder layers, two MTP depths.
    let p = parse("/MM/MM");
    assert_eq!(
        (p.physical_count(), p.logical_count(), p.mtp_depth_count()),
        (0, 0, 2)
    );
    assert_eq!(p.segments.len(), 1);
    assert!(p.segments[0].items.is_empty());
    assert_eq!(p.canonical(), "/MM/MM");
}

#[test]
fn megatron_failures_fail_as_the_spec_says() {
    check(&[
        ("M[[M]]", &[(Code::H005, "1:3")]),
        ("M[EM]", &[(Code::H006, "1:3")]),
        ("M[M*]X", &[(Code::H001, "1:6")]),
        ("M[M*", &[(Code::H002, "1:2")]),
        ("M[]", &[(Code::H004, "1:2")]),
    ]);
}

#[test]
fn a_trailing_slash_means_no_mtp() {
    // `main/` and `main//`.
    for source in ["M*E/", "M*E//", "M*E/ /", "M*E///"] {
        let p = parse(source);
        assert_eq!(p.mtp_depth_count(), 0, "{source:?}");
        assert_eq!(p.canonical(), "M*E", "{source:?}");
    }
    // An empty main with only slashes is an empty model.
    let p = parse("//");
    assert_eq!((p.physical_count(), p.mtp_depth_count()), (0, 0));
    assert_eq!(p.canonical(), "");
}

// ---- every rule, by code ---------------------------------------------------

#[test]
fn h001_unknown_symbol() {
    check(&[
        ("M*x", &[(Code::H001, "1:3")]),
        ("m", &[(Code::H001, "1:1")]),
        ("MqE", &[(Code::H001, "1:2")]),
        ("M3", &[(Code::H001, "1:2")]),
        // Every unknown symbol is reported, not only the first.
        (
            "mxe",
            &[
                (Code::H001, "1:1"),
                (Code::H001, "1:2"),
                (Code::H001, "1:3"),
            ],
        ),
        // Inside groups and MTP depths too.
        ("[Mx]", &[(Code::H001, "1:3")]),
        ("M/Mq", &[(Code::H001, "1:4")]),
        // Non-ASCII: one diagnostic per character, columns in characters.
        ("Mé*", &[(Code::H001, "1:2")]),
        ("ééM", &[(Code::H001, "1:1"), (Code::H001, "1:2")]),
    ]);
}

#[test]
fn h001_suggests_the_likely_symbol() {
    for (typo, meant) in [
        ("m", 'M'),
        ("e", 'E'),
        ("d", 'D'),
        ("g", 'G'),
        ("x", '*'),
        ("X", '*'),
        ("a", '*'),
        ("×", '*'),
        ("_", '-'),
        ("=", '-'),
        ("–", '-'),
        ("l", '+'),
    ] {
        let help = help(typo);
        assert!(
            help.starts_with(&format!("did you mean `{meant}`")),
            "{typo:?}: {help}"
        );
    }
    // No guess for a symbol that resembles nothing; the help lists them all.
    assert_eq!(
        help("q"),
        "layer symbols are M * + D G - E; structure is [ ] | / and ( ){N}"
    );
    // A digit outside braces is a misplaced count.
    assert_eq!(
        help("M3"),
        "a repeat count goes in braces after the item: `M{3}`"
    );
    let d = Pattern::parse("M*x").unwrap_err();
    assert_eq!(d.items[0].message, "unknown layer symbol `x`");
}

#[test]
fn h002_unclosed_group() {
    check(&[
        ("M[M*", &[(Code::H002, "1:2")]),
        // `[M|E]` and `[M/E]` fail this way, and only this way: the `]` after
        // the boundary is the group's intended closer, not a stray.
        ("[M|E]", &[(Code::H002, "1:1")]),
        ("[M/E]", &[(Code::H002, "1:1")]),
        ("[ME|[*E]", &[(Code::H002, "1:1")]),
        ("M[M*]|[ME", &[(Code::H002, "1:7")]),
        ("[M|[E", &[(Code::H002, "1:1"), (Code::H002, "1:4")]),
        // A group cannot run past the end of a repeat block either; the `)`
        // still closes the block.
        ("([M){2}", &[(Code::H002, "1:2")]),
    ]);
    let d = Pattern::parse("[M|E]").unwrap_err();
    assert_eq!(
        d.items[0].message,
        "unclosed group: this `[` has no `]` before the `|` at 1:3"
    );
}

#[test]
fn h003_stray_close() {
    check(&[
        ("M*]E", &[(Code::H003, "1:3")]),
        ("]", &[(Code::H003, "1:1")]),
        ("[M]]", &[(Code::H003, "1:4")]),
        // A `]` before an unclosed `[` cannot be its closer: both are errors.
        ("]M[E", &[(Code::H003, "1:1"), (Code::H002, "1:3")]),
        // One `]` closes the unclosed group; the second closes nothing.
        ("[M|E]]", &[(Code::H002, "1:1"), (Code::H003, "1:6")]),
        ("M|]", &[(Code::H003, "1:3")]),
    ]);
}

#[test]
fn h004_empty_group() {
    check(&[
        ("M[]", &[(Code::H004, "1:2")]),
        ("[]", &[(Code::H004, "1:1")]),
        ("[ ]", &[(Code::H004, "1:1")]),
        ("M[]|[]", &[(Code::H004, "1:2"), (Code::H004, "1:5")]),
    ]);
}

#[test]
fn h005_nested_group() {
    check(&[
        ("M[[M]]", &[(Code::H005, "1:3")]),
        ("[M[E]]", &[(Code::H005, "1:3")]),
        ("[*[M]E]", &[(Code::H005, "1:3")]),
    ]);
    let d = Pattern::parse("M[[M]]").unwrap_err();
    assert_eq!(
        d.items[0].message,
        "nested group: a `[` inside the group opened at 1:2"
    );
}

#[test]
fn h006_moe_not_last_in_group() {
    check(&[
        ("M[EM]", &[(Code::H006, "1:3")]),
        ("[E*E]", &[(Code::H006, "1:2")]),
        ("[MEE]", &[(Code::H006, "1:3")]),
        // One misplaced terminal is one error, not also H007.
        ("[E-]", &[(Code::H006, "1:2")]),
        ("[*E][EM]", &[(Code::H006, "1:6")]),
    ]);
}

#[test]
fn h007_dense_mlp_not_last_or_two_terminals() {
    check(&[
        ("[-*]", &[(Code::H007, "1:2")]),
        ("[-E]", &[(Code::H007, "1:2")]),
        ("[--]", &[(Code::H007, "1:2")]),
        ("[M-*]", &[(Code::H007, "1:3")]),
        ("[---]", &[(Code::H007, "1:2"), (Code::H007, "1:3")]),
    ]);
    // A `-` that ends its group is fine.
    parse("[*-][M-]");
}

#[test]
fn h008_two_members_publish_the_same_names() {
    check(&[
        ("[**E]", &[(Code::H008, "1:3")]),
        ("[MM]", &[(Code::H008, "1:3")]),
        // The whole attention family shares `self_attention.`.
        ("[*G]", &[(Code::H008, "1:3")]),
        ("[+GE]", &[(Code::H008, "1:3")]),
        ("[MGM-]", &[(Code::H008, "1:4")]),
        ("[M*M*E]", &[(Code::H008, "1:4"), (Code::H008, "1:5")]),
        // Independent of H009: both rules are broken.
        ("[*+E]", &[(Code::H008, "1:3"), (Code::H009, "1:3")]),
    ]);
    // One of each namespace is fine.
    parse("[MGE][M+-][D]");
}

#[test]
fn h009_gqa_mixed_with_latent_attention() {
    check(&[
        ("M*M+", &[(Code::H009, "1:4")]),
        ("+*", &[(Code::H009, "1:2")]),
        ("*D", &[(Code::H009, "1:2")]),
        // MTP depths count too.
        ("M*/+", &[(Code::H009, "1:4")]),
        // Reported once, at the first layer of the second family.
        ("M*M+M+D", &[(Code::H009, "1:4")]),
    ]);
    // G mixes with either family; + and D are one family.
    parse("*G/*G");
    parse("+DG/+DG");
}

#[test]
fn h010_mtp_depths_differ() {
    check(&[
        ("/ME/M", &[(Code::H010, "1:4")]),
        // An empty trailing depth after real ones.
        ("/ME/", &[(Code::H010, "1:4")]),
        ("M*/ME/ME/M", &[(Code::H010, "1:9")]),
        ("M/ME/ME/", &[(Code::H010, "1:8")]),
        ("M/ME//ME", &[(Code::H010, "1:5")]),
        // Each depth is compared with the first; depth 3 matches it.
        ("/M/E/M", &[(Code::H010, "1:3")]),
    ]);
    let d = Pattern::parse("/ME/M").unwrap_err();
    assert_eq!(d.items[0].message, "MTP depth 2 is `M` but depth 1 is `ME`");
    let d = Pattern::parse("/ME/").unwrap_err();
    assert_eq!(
        d.items[0].message,
        "MTP depth 2 is nothing but depth 1 is `ME`"
    );
    parse("M/ME/ME/ME");
}

#[test]
fn h011_structure_in_an_mtp_depth() {
    check(&[
        ("M/[ME]", &[(Code::H011, "1:3")]),
        ("M/M|E", &[(Code::H011, "1:4")]),
        ("M/M]", &[(Code::H011, "1:4")]),
        // The depth is still read as `ME`: no H010 against an equal depth...
        ("M/[ME]/ME", &[(Code::H011, "1:3")]),
        ("M/M|E/ME", &[(Code::H011, "1:4")]),
        // ...and an independent H010 against a different one.
        ("M/[ME]/M", &[(Code::H011, "1:3"), (Code::H010, "1:7")]),
    ]);
}

#[test]
fn h012_malformed_repeats() {
    check(&[
        ("M{0}", &[(Code::H012, "1:2")]),
        ("M{x}", &[(Code::H012, "1:2")]),
        ("{3}M", &[(Code::H012, "1:1")]),
        ("(M*)", &[(Code::H012, "1:1")]),
        // The block stops at `|`; its `)` is not reported again.
        ("(M|*){2}", &[(Code::H012, "1:1")]),
        ("(M/*){2}", &[(Code::H012, "1:1")]),
        ("M{}", &[(Code::H012, "1:2")]),
        ("M{3", &[(Code::H012, "1:2")]),
        ("M{-1}", &[(Code::H012, "1:2")]),
        ("M{2.5}", &[(Code::H012, "1:2")]),
        ("M{100001}", &[(Code::H012, "1:2")]),
        ("M{99999999999999999999999}", &[(Code::H012, "1:2")]),
        ("M)", &[(Code::H012, "1:2")]),
        ("M}", &[(Code::H012, "1:2")]),
        ("(M){2}{3}", &[(Code::H012, "1:7")]),
        ("[(ME){2}]", &[(Code::H012, "1:2")]),
        ("|{2}", &[(Code::H012, "1:2")]),
        // One repeat over 1,000,000 layers: reported at its count.
        ("(M{100000}){11}", &[(Code::H012, "1:12")]),
        // Each repeat within the limit, the whole pattern over it.
        ("(M{1000}){1000}(M{1000}){1000}", &[(Code::H012, "1:1")]),
    ]);
    let d = Pattern::parse("M{0}").unwrap_err();
    assert_eq!(
        d.items[0].message,
        "repeat count 0: a repeat writes at least one copy"
    );
    let d = Pattern::parse("(M{1000}){1000}(M{1000}){1000}").unwrap_err();
    assert_eq!(
        d.items[0].message,
        "the pattern expands to 2000000 layers, over the limit of 1000000"
    );
}

#[test]
fn repeats_at_the_limits_are_fine() {
    let p = parse("M{100000}");
    assert_eq!(p.physical_count(), 100_000);
    let p = parse("(M{1000}){1000}");
    assert_eq!(p.physical_count(), 1_000_000);
    let p = parse("M{1}");
    assert_eq!(p.canonical(), "M");
}

// ---- several errors at once, and no cascades --------------------------------

#[test]
fn independent_errors_are_reported_together() {
    check(&[
        (
            "mM[EM]]x",
            &[
                (Code::H001, "1:1"),
                (Code::H006, "1:4"),
                (Code::H003, "1:7"),
                (Code::H001, "1:8"),
            ],
        ),
        (
            "M[M*|[]|x/ME/",
            &[
                (Code::H002, "1:2"),
                (Code::H004, "1:6"),
                (Code::H001, "1:9"),
                (Code::H010, "1:13"),
            ],
        ),
        (
            "[EM][-*][**E]M+/[*]",
            &[
                (Code::H006, "1:2"),
                (Code::H007, "1:6"),
                (Code::H008, "1:11"),
                (Code::H009, "1:15"),
                (Code::H011, "1:17"),
            ],
        ),
    ]);
}

#[test]
fn one_mistake_is_one_error() {
    check(&[
        // An unclosed group does not also make its `]` a stray.
        ("[M|E]", &[(Code::H002, "1:1")]),
        ("[M/E]", &[(Code::H002, "1:1")]),
        // An unclosed block does not also make its `)` a stray.
        ("(M|*){2}", &[(Code::H012, "1:1")]),
        // A `)` in a group outside any block is a stray, not also the end
        // of the group: the `]` still closes it.
        ("[M)E]", &[(Code::H012, "1:3")]),
        ("[[M)E]]", &[(Code::H005, "1:2"), (Code::H012, "1:4")]),
        // ...and when it is the `)` of a block cut short by `|`, nothing more.
        ("(M|[E)]", &[(Code::H012, "1:1")]),
        // A group without `]` inside a block still ends at the block's `)`.
        ("([M){2}", &[(Code::H002, "1:2")]),
        // An unclosed group's extent is a guess: the group rules are not
        // applied to it, so a missing `]` is not also H006/H008.
        ("(M[*E*){4}|[*E]", &[(Code::H002, "1:3")]),
        ("[**E", &[(Code::H002, "1:1")]),
        // A repeat copies a mistake; it is reported once.
        ("[EM]{3}", &[(Code::H006, "1:2")]),
        ("(M*M+){2}", &[(Code::H009, "1:5")]),
        // A depth that lost a layer to a syntax error is not also compared
        // with the other depths (H010).
        ("M/ME/x", &[(Code::H001, "1:6")]),
        ("M/ME/Mx", &[(Code::H001, "1:7")]),
        ("M/M{0}E/ME", &[(Code::H012, "1:4")]),
        ("M/[[M]E]/ME", &[(Code::H011, "1:3"), (Code::H005, "1:4")]),
        // The first intact depth is then the reference.
        ("M/x/ME/M", &[(Code::H001, "1:3"), (Code::H010, "1:7")]),
    ]);
    let d = Pattern::parse("M/x/ME/M").unwrap_err();
    assert_eq!(d.items[1].message, "MTP depth 3 is `M` but depth 2 is `ME`");
}

#[test]
fn nesting_deeper_than_the_limit_is_an_error() {
    // Not a stack overflow: one error at the first opener past 64 levels.
    let source = "(".repeat(10_000);
    assert_eq!(errors(&source), [(Code::H012, "1:65".to_string())]);
    let source = "[".repeat(10_000);
    assert_eq!(errors(&source), [(Code::H005, "1:65".to_string())]);
}

// ---- positions ---------------------------------------------------------------

#[test]
fn positions_on_multi_line_patterns() {
    check(&[
        ("M*\n[EM]\n  x", &[(Code::H006, "2:2"), (Code::H001, "3:3")]),
        ("M\r\n[EM]", &[(Code::H006, "2:2")]),
        ("M\n\n\t]", &[(Code::H003, "3:2")]),
        ("/ME\n/M", &[(Code::H010, "2:1")]),
    ]);
}

#[test]
fn columns_count_characters_after_non_ascii() {
    check(&[
        // `é` is two bytes; the `[` after it is still column 3.
        ("Mé[EM]", &[(Code::H001, "1:2"), (Code::H006, "1:4")]),
        (
            "é é\n[EM]",
            &[
                (Code::H001, "1:1"),
                (Code::H001, "1:3"),
                (Code::H006, "2:2"),
            ],
        ),
        ("M—[-*]", &[(Code::H001, "1:2"), (Code::H007, "1:4")]),
    ]);
}

#[test]
fn spans_cover_the_culprit() {
    let d = Pattern::parse("Mé[]").unwrap_err();
    let spans: Vec<_> = d.items.iter().map(|i| i.span.unwrap()).collect();
    // `é` is bytes 1..3; the empty group `[]` bytes 3..5.
    assert_eq!(
        spans,
        [
            hybridgen_dsl::Span::new(1, 3),
            hybridgen_dsl::Span::new(3, 5)
        ]
    );
}

// ---- sugar -------------------------------------------------------------------

#[test]
fn white_space_is_ignored_anywhere() {
    for (sugar, plain) in [
        ("[M E]", "[ME]"),
        (" M * \n - ", "M*-"),
        ("\tM\r\n[ * E ]\n|\n- / * E ", "M[*E]|-/*E"),
        ("M { 3 }", "MMM"),
        ("M{1 0}", "MMMMMMMMMM"),
        ("( M [ * E ] ) { 2 }", "M[*E]M[*E]"),
    ] {
        assert_eq!(parse(sugar).canonical(), plain, "{sugar:?}");
    }
    // Positions still point at the culprit.
    check(&[("[ E M ]", &[(Code::H006, "1:3")])]);
}

#[test]
fn repeats_expand_inside_one_segment() {
    for (sugar, plain) in [
        ("(M[*E]){4}", "M[*E]M[*E]M[*E]M[*E]"),
        ("M{3}", "MMM"),
        ("MM{3}", "MMMM"),
        ("[*E]{2}", "[*E][*E]"),
        ("[M{1}E]", "[ME]"),
        ("((M*){2}-){2}", "M*M*-M*M*-"),
        ("(M){1}", "M"),
        ("(M[*E]){2}|-{2}", "M[*E]M[*E]|--"),
        ("M/(ME){2}", "M/MEME"),
        ("M/E{2}/EE", "M/EE/EE"),
    ] {
        assert_eq!(parse(sugar).canonical(), plain, "{sugar:?}");
    }
    let p = parse("(M[*E]){4}");
    assert_eq!((p.physical_count(), p.logical_count()), (12, 8));
}

#[test]
fn a_repeated_layer_keeps_the_span_of_its_symbol() {
    let p = parse("*M{3}");
    let spans: Vec<usize> = p.layers().map(|l| l.span.start).collect();
    assert_eq!(spans, [0, 1, 1, 1]);
}

// ---- counts, segments and canonical printing ---------------------------------------

#[test]
fn counts_of_segments_groups_and_mtp() {
    // (source, physical, logical, MTP depths, segments)
    for (source, physical, logical, mtp, segments) in [
        ("", 0, 0, 0, 1),
        ("|", 0, 0, 0, 2),
        ("M||M", 2, 2, 0, 3),
        ("M[M*]-", 4, 3, 0, 1),
        ("[*E][*E]|[*E][*E]", 8, 4, 0, 2),
        ("[M*E][M*E]/*E", 6, 2, 1, 1),
        ("/MM/MM", 0, 0, 2, 1),
        ("M-M-|M*-/ME/ME/ME", 7, 7, 3, 2),
        ("[M*-]{3}|", 9, 3, 0, 2),
    ] {
        let p = parse(source);
        assert_eq!(
            (
                p.physical_count(),
                p.logical_count(),
                p.mtp_depth_count(),
                p.segments.len()
            ),
            (physical, logical, mtp, segments),
            "{source:?}"
        );
    }
}

#[test]
fn kinds_lists_every_kind_used_mtp_included() {
    let p = parse("M[*E]/G");
    assert_eq!(
        p.kinds(),
        [
            LayerKind::Mamba,
            LayerKind::Attention,
            LayerKind::GatedDeltaNet,
            LayerKind::Moe
        ]
    );
    assert!(p.has_groups());
    assert!(!parse("M*/*").has_groups());
}

#[test]
fn canonical_form_is_plain_megatron() {
    for (source, canonical) in [
        ("M[M*]-", "M[M*]-"),
        (" ( M [ * E ] ) { 2 } | - / * E ", "M[*E]M[*E]|-/*E"),
        ("/MM/MM", "/MM/MM"),
        ("M*E//", "M*E"),
        ("|", "|"),
        ("M|", "M|"),
        ("+D G", "+DG"),
    ] {
        let p = parse(source);
        assert_eq!(p.canonical(), canonical, "{source:?}");
        assert_eq!(p.to_string(), canonical);
        // The canonical form reads back as itself.
        assert_eq!(parse(canonical).canonical(), canonical);
    }
    let p: Pattern = "M*".parse().unwrap();
    assert_eq!(p.canonical(), "M*");
}

// ---- rendering -------------------------------------------------------------------------

#[test]
fn renders_one_error_for_the_terminal() {
    let d = Pattern::parse("M[[M]]").unwrap_err();
    assert_eq!(
        d.to_string(),
        "error[H005]: nested group: a `[` inside the group opened at 1:2\n \
         --> pattern:1:3\n  \
         |\n\
         1 | M[[M]]\n  \
         |   ^ groups cannot contain groups\n  \
         = help: a group is one flat stack: remove the inner brackets, or close the outer group first\n"
    );
}

#[test]
fn renders_two_errors_for_the_terminal() {
    let d = Pattern::parse("M*x[EM]").unwrap_err();
    assert_eq!(
        d.to_string(),
        "error[H001]: unknown layer symbol `x`\n \
         --> pattern:1:3\n  \
         |\n\
         1 | M*x[EM]\n  \
         |   ^ not a layer symbol\n  \
         = help: did you mean `*` (self-attention)?\n\
         \n\
         error[H006]: `E` is not the last layer of its group\n \
         --> pattern:1:5\n  \
         |\n\
         1 | M*x[EM]\n  \
         |     ^ a MoE layer ends its group\n  \
         = help: move the `E` to the end (`[ME]`) or split the group after it (`[E][M]`)\n\
         \n\
         2 errors"
    );
}

#[test]
fn renders_wide_spans_and_two_digit_lines() {
    // The caret covers the whole empty group.
    let d = Pattern::parse("M[]").unwrap_err();
    assert_eq!(
        d.to_string(),
        "error[H004]: empty group\n \
         --> pattern:1:2\n  \
         |\n\
         1 | M[]\n  \
         |  ^^ a group needs at least one layer\n  \
         = help: remove the brackets, or put the layers to group inside them\n"
    );
    // Line 10: the gutter widens.
    let source = "M\n".repeat(9) + "x";
    let d = Pattern::parse(&source).unwrap_err();
    assert_eq!(
        d.to_string(),
        "error[H001]: unknown layer symbol `x`\n  \
         --> pattern:10:1\n   \
         |\n\
         10 | x\n   \
         | ^ not a layer symbol\n   \
         = help: did you mean `*` (self-attention)?\n"
    );
}

#[test]
fn carets_line_up_under_tabs() {
    // The caret line copies the tabs before the culprit, so it lines up in a
    // terminal whatever the tab width.
    let d = Pattern::parse("\tM\t[EM]").unwrap_err();
    assert_eq!(
        d.to_string(),
        "error[H006]: `E` is not the last layer of its group\n \
         --> pattern:1:5\n  \
         |\n\
         1 | \tM\t[EM]\n  \
         | \t \t ^ a MoE layer ends its group\n  \
         = help: move the `E` to the end (`[ME]`) or split the group after it (`[E][M]`)\n"
    );
}

#[test]
fn renders_inline_for_compile_errors() {
    let d = Pattern::parse("M[EM]").unwrap_err();
    assert_eq!(
        d.items[0].render_inline(&d.source),
        "[H006] `E` is not the last layer of its group\n  \
         at 1:3:\n    \
         M[EM]\n      \
         ^ a MoE layer ends its group\n  \
         help: move the `E` to the end (`[ME]`) or split the group after it (`[E][M]`)"
    );
}

#[test]
fn every_code_has_a_title_and_an_explanation() {
    for code in Code::ALL {
        assert!(!code.title().is_empty(), "{code}");
        assert!(code.explanation().len() > 40, "{code}");
        assert_eq!(Code::parse(code.as_str()), Some(code));
    }
}
