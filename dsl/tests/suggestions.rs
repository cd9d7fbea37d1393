//! Every help text proposes something valid. A help quotes in backticks
//! either a name (a field, a flag, a preset: text outside the pattern
//! alphabet), a lone bracket, or a pattern it proposes; every proposed
//! pattern must parse, and plan over the `tiny` preset when it has layers.
//! The corpus holds a mistake for every code, the cases where the obvious
//! fix is itself a mistake (`M[E-]`: moving the `E` last gives `[-E]`, two
//! terminals), and random patterns.

use hybridgen_dsl::config::ModelConfig;
use hybridgen_dsl::pattern::Pattern;
use hybridgen_dsl::plan::{ParallelLayout, Plan, PlanOptions};
use hybridgen_dsl::{Code, Diagnostic};
use proptest::prelude::*;
use std::collections::BTreeSet;

/// Characters a pattern is written with; a quote with any other is a name.
const PATTERN_ALPHABET: &str = "M*+DGE-[]|/(){}0123456789 ";
/// Quoted syntax that is not a pattern on its own.
const LONE_BRACKETS: [&str; 4] = ["[", "]", "(", ")"];

fn tiny(pattern: &str) -> ModelConfig {
    let mut config = ModelConfig::preset("tiny").expect("the tiny preset");
    config.pattern = pattern.to_string();
    config
}

/// The patterns a help proposes.
fn proposals(help: &str) -> Vec<&str> {
    help.split('`')
        .skip(1)
        .step_by(2)
        .filter(|quote| quote.chars().all(|c| PATTERN_ALPHABET.contains(c)))
        .filter(|quote| !LONE_BRACKETS.contains(quote))
        .collect()
}

/// Why `proposal` is not a valid pattern, if it is not. `tolerated`: the
/// model-wide mistakes of the pattern the help is about (H009, one
/// attention family), which a proposal quoting that pattern's own layers
/// keeps; nothing else is forgiven.
fn invalid(proposal: &str, tolerated: &[Code]) -> Option<String> {
    let diagnostics = match Pattern::parse(proposal) {
        Err(d) => d,
        Ok(pattern) if pattern.physical_count() + pattern.mtp_depths.len() == 0 => return None,
        Ok(_) => Plan::new(&tiny(proposal), &PlanOptions::default()).err()?,
    };
    diagnostics
        .items
        .iter()
        .any(|d| !tolerated.contains(&d.code))
        .then(|| diagnostics.to_string())
}

/// Every diagnostic of `pattern` under `layout`, from the parser and the
/// planner.
fn diagnostics(pattern: &str, layout: ParallelLayout) -> Vec<Diagnostic> {
    let options = PlanOptions {
        layout,
        ..PlanOptions::default()
    };
    match Plan::new(&tiny(pattern), &options) {
        Ok(_) => Vec::new(),
        Err(d) => d.items,
    }
}

/// Checks every proposal of every diagnostic; returns how many there were.
fn check_helps(pattern: &str, found: &[Diagnostic]) -> Result<usize, String> {
    let tolerated: Vec<Code> = found
        .iter()
        .map(|d| d.code)
        .filter(|&code| code == Code::H009)
        .collect();
    let mut checked = 0;
    for d in found {
        for proposal in proposals(&d.help) {
            if let Some(why) = invalid(proposal, &tolerated) {
                return Err(format!(
                    "{pattern:?}: [{}] help `{}` proposes `{proposal}`, which is invalid:\n{why}",
                    d.code, d.help
                ));
            }
            checked += 1;
        }
        if d.code == Code::H001 {
            check_in_place(pattern, d, &tolerated)?;
        }
    }
    Ok(checked)
}

/// An unknown symbol's proposed replacement, put in its place, must not mix
/// attention families (H009) where the pattern did not already.
fn check_in_place(pattern: &str, d: &Diagnostic, tolerated: &[Code]) -> Result<(), String> {
    let proposed = proposals(&d.help);
    let (Some(span), [symbol]) = (d.span, proposed.as_slice()) else {
        return Ok(());
    };
    let fixed = format!("{}{symbol}{}", &pattern[..span.start], &pattern[span.end..]);
    let mixes = |source: &str| {
        Pattern::parse(source)
            .err()
            .is_some_and(|e| e.codes().contains(&Code::H009))
    };
    if mixes(&fixed) && !tolerated.contains(&Code::H009) {
        return Err(format!(
            "{pattern:?}: [H001] help `{}` gives {fixed:?}, which mixes attention families",
            d.help
        ));
    }
    Ok(())
}

fn pipeline(pp: usize, first: Option<usize>) -> ParallelLayout {
    ParallelLayout {
        pp,
        first_stage_layers: first,
        ..ParallelLayout::default()
    }
}

#[test]
fn every_proposal_in_a_help_is_a_valid_pattern() {
    let plain = ParallelLayout::default;
    let corpus: Vec<(&str, ParallelLayout)> = vec![
        // H001-H005, H011, H012: syntax.
        ("M*x", plain()),
        ("M*d", plain()),
        ("Mm", plain()),
        ("M_", plain()),
        ("M3", plain()),
        ("M?", plain()),
        ("M[*E", plain()),
        ("[M|E]", plain()),
        ("[M/E]", plain()),
        ("(M[*E){2}", plain()),
        ("M*]", plain()),
        ("M*/]", plain()),
        ("M[]", plain()),
        ("M[[M]]", plain()),
        ("M*/[ME]", plain()),
        ("M*/M|E", plain()),
        ("M{0}", plain()),
        ("M{x}", plain()),
        ("{3}M", plain()),
        ("(M*)", plain()),
        ("(M|*){2}", plain()),
        ("M*)", plain()),
        ("[(M){2}E]", plain()),
        ("[M{2}E]", plain()),
        ("M{100001}", plain()),
        // H006-H008: a group's rules, including groups where moving the
        // culprit last is no fix.
        ("M[EM]", plain()),
        ("M[E-]", plain()),
        ("[E-M]", plain()),
        ("[EE]", plain()),
        ("[EMM]", plain()),
        ("[*E*]", plain()),
        ("[-*]", plain()),
        ("[-E]", plain()),
        ("[--]", plain()),
        ("[-MM]", plain()),
        ("[-*E]", plain()),
        ("[MM]", plain()),
        ("[**E]", plain()),
        ("[*GE]", plain()),
        ("[E{40}M]", plain()),
        // H009, H010.
        ("M*M+", plain()),
        ("M+x", plain()),
        ("M*/ME/M", plain()),
        ("M*/ME/", plain()),
        // H020-H023, H028: the layout.
        ("M*|M*|M*", pipeline(2, None)),
        ("M*M*M", pipeline(2, None)),
        ("[M*][M*]M", pipeline(2, None)),
        ("M[*E]-", pipeline(2, None)),
        ("[M*E][M*E][M*E][M*E]", pipeline(3, Some(2))),
        ("M|M", pipeline(2, Some(1))),
        ("M*M*", pipeline(1, Some(1))),
        (
            "[*E]",
            ParallelLayout {
                dp: 3,
                ep: 3,
                ..ParallelLayout::default()
            },
        ),
        ("", plain()),
        ("|/", plain()),
    ];
    let mut codes = BTreeSet::new();
    let mut checked = 0;
    for (pattern, layout) in corpus {
        let found = diagnostics(pattern, layout);
        assert!(!found.is_empty(), "{pattern:?} should be refused");
        codes.extend(found.iter().map(|d| d.code));
        checked += check_helps(pattern, &found).unwrap_or_else(|why| panic!("{why}"));
    }
    // The corpus reaches every code the pattern and layout can break.
    let missing: Vec<Code> = Code::ALL
        .into_iter()
        .filter(|c| !matches!(c, Code::H025 | Code::H026 | Code::H027))
        .filter(|c| !codes.contains(c))
        .collect();
    assert!(missing.is_empty(), "no case for {missing:?}");
    assert!(checked >= 40, "only {checked} proposals checked");
}

/// The case the rule was written for: `M[E-]` must not be told to write
/// `[-E]`, and is told a fix that works.
#[test]
fn moe_before_mlp_is_told_to_split_the_group() {
    let found = diagnostics("M[E-]", ParallelLayout::default());
    let h006 = found
        .iter()
        .find(|d| d.code == Code::H006)
        .expect("an H006");
    assert!(!h006.help.contains("[-E]"), "{}", h006.help);
    assert_eq!(proposals(&h006.help), ["[E][-]"], "{}", h006.help);
}

/// An unknown symbol is guessed to be the attention the pattern already
/// uses: `x` is `*` beside `*`, but `+` beside `+` or `D`; `d` is `D` beside
/// `+`, but `*` beside `*`.
#[test]
fn an_unknown_attention_symbol_is_guessed_in_the_pattern_s_family() {
    for (pattern, guess) in [
        ("M*x", "*"),
        ("M+x", "+"),
        ("MDx", "+"),
        ("M*l", "*"),
        ("Ml", "+"),
        ("M*d", "*"),
        ("M+d", "D"),
    ] {
        let found = diagnostics(pattern, ParallelLayout::default());
        assert_eq!(found.len(), 1, "{pattern}: {found:?}");
        assert_eq!(
            proposals(&found[0].help),
            [guess],
            "{pattern}: {}",
            found[0].help
        );
        check_helps(pattern, &found).unwrap_or_else(|why| panic!("{why}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random patterns over the alphabet and a few strangers.
    #[test]
    fn random_patterns_get_valid_proposals(
        pattern in "[-M*+DGE\\[\\]|/(){}0-9 xmld]{0,20}",
        pp in 1usize..4,
    ) {
        let found = diagnostics(&pattern, pipeline(pp, None));
        check_helps(&pattern, &found).map_err(TestCaseError::fail)?;
    }
}
