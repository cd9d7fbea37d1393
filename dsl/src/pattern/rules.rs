//! The semantic rules of a pattern (H006-H010): what a well-formed syntax tree
//! may still get wrong about groups, attention families and MTP depths.

use super::{Group, Layer, LayerKind, Namespace, Pattern};
use crate::diagnostic::{Code, Diagnostic, Findings, shorten};
use std::collections::HashSet;

/// The most symbols of the pattern a message or help quotes.
const MAX_QUOTED: usize = 32;

/// `lossy_depths` marks the MTP depths a syntax error already took layers
/// from: they are left out of the H010 comparison.
pub(super) fn check(pattern: &Pattern, lossy_depths: &[bool]) -> Findings {
    let mut out = Findings::default();
    // The copies a repeat makes of a group are the same group, spans and
    // all: check each written group once.
    let mut checked = HashSet::new();
    for item in pattern.items() {
        if let super::Item::Group(group) = item
            && checked.insert(group.span)
        {
            check_group(group, &mut out);
        }
    }
    check_attention_families(pattern, &mut out);
    check_mtp_depths(pattern, lossy_depths, &mut out);
    out
}

/// H006, H007, H008. Each member gets at most one of them, in that order of
/// precedence, so one misplaced terminal is one error.
fn check_group(group: &Group, out: &mut Findings) {
    let last = group.members.len() - 1;
    let mut flagged = vec![false; group.members.len()];
    // The one split every help below can propose.
    let split = valid_split(&group.members);
    for (i, member) in group.members.iter().enumerate() {
        if i == last {
            continue;
        }
        match member.kind {
            LayerKind::Moe => {
                flagged[i] = true;
                out.push(
                    Diagnostic::new(Code::H006, "`E` is not the last layer of its group")
                        .at(member.span)
                        .label("a MoE layer ends its group")
                        .help(match (moved_last(&group.members, i), &split) {
                            (Some(moved), Some(split)) => format!(
                                "move the `E` to the end (`{moved}`) or split the group after it (`{split}`)"
                            ),
                            (None, Some(split)) => format!("split the group after it: `{split}`"),
                            _ => "move the `E` to the end of the group or split the group after it"
                                .to_string(),
                        }),
                );
            }
            LayerKind::Mlp => {
                flagged[i] = true;
                let terminal_after = group.members[i + 1..].iter().any(|m| m.kind.is_terminal());
                let message = if terminal_after {
                    "a group with two terminals (`-` and a later `-` or `E`)"
                } else {
                    "`-` is not the last layer of its group"
                };
                out.push(
                    Diagnostic::new(Code::H007, message)
                        .at(member.span)
                        .label("a dense MLP ends its group")
                        .help(match (terminal_after, moved_last(&group.members, i), &split) {
                            (true, _, Some(split)) => format!(
                                "a group has at most one terminal (`-` or `E`): split the group: `{split}`"
                            ),
                            (true, _, None) => {
                                "a group has at most one terminal (`-` or `E`): split the group after each"
                                    .to_string()
                            }
                            (false, Some(moved), _) => format!("move the `-` to the end: `{moved}`"),
                            (false, None, Some(split)) => {
                                format!("split the group after the `-`: `{split}`")
                            }
                            (false, None, None) => {
                                "move the `-` to the end of the group or split the group after it"
                                    .to_string()
                            }
                        }),
                );
            }
            _ => {}
        }
    }
    // Terminals are covered above: two of them always put one before the end.
    for namespace in CLASHING {
        let mut first: Option<&Layer> = None;
        for (i, member) in group.members.iter().enumerate() {
            if member.kind.namespace() != namespace {
                continue;
            }
            match first {
                None => first = Some(member),
                Some(first) if !flagged[i] => {
                    let prefix = match namespace {
                        Namespace::Mixer => "mixer.",
                        _ => "self_attention.",
                    };
                    out.push(
                        Diagnostic::new(
                            Code::H008,
                            format!(
                                "`{}` and `{}` in one group both publish checkpoint keys under `decoder.layers.L.{prefix}`",
                                first.kind, member.kind
                            ),
                        )
                        .at(member.span)
                        .label("collides with an earlier member")
                        .help(match &split {
                            Some(split) => format!(
                                "a group flattens into one checkpoint layer: put these layers in separate groups: `{split}`"
                            ),
                            None => "a group flattens into one checkpoint layer: put these layers in separate groups".to_string(),
                        }),
                    );
                }
                Some(_) => {}
            }
        }
    }
}

/// The group with member `moved` taken out and put last, when that makes a
/// valid group (another terminal or a namespace clash would not); `None`
/// too for a group too long to quote (every member of `[E{100000}M]` is an
/// error, and quoting the group in each would be quadratic).
fn moved_last(members: &[Layer], moved: usize) -> Option<String> {
    if members.len() > MAX_QUOTED {
        return None;
    }
    let kinds: Vec<LayerKind> = members
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != moved)
        .chain(std::iter::once((moved, &members[moved])))
        .map(|(_, m)| m.kind)
        .collect();
    is_valid_group(&kinds).then(|| bracketed(&kinds))
}

/// The group cut, in order, into valid groups: after each terminal and
/// before each member whose namespace is already taken. `None` for a group
/// too long to quote.
fn valid_split(members: &[Layer]) -> Option<String> {
    if members.len() > MAX_QUOTED {
        return None;
    }
    let mut out = String::new();
    let mut current: Vec<LayerKind> = Vec::new();
    for member in members {
        let kind = member.kind;
        let taken = current
            .iter()
            .any(|k| k.namespace() == kind.namespace() && shares_checkpoint_keys(kind.namespace()));
        if taken {
            out += &bracketed(&current);
            current.clear();
        }
        current.push(kind);
        if kind.is_terminal() {
            out += &bracketed(&current);
            current.clear();
        }
    }
    if !current.is_empty() {
        out += &bracketed(&current);
    }
    Some(out)
}

/// The rules H006-H008 check, for members of these kinds: at most one
/// terminal and it comes last, and no two members publish under one
/// checkpoint namespace.
fn is_valid_group(kinds: &[LayerKind]) -> bool {
    let terminal_inside = kinds
        .iter()
        .take(kinds.len().saturating_sub(1))
        .any(|k| k.is_terminal());
    let clash = kinds.iter().enumerate().any(|(i, a)| {
        shares_checkpoint_keys(a.namespace())
            && kinds[..i].iter().any(|b| b.namespace() == a.namespace())
    });
    !kinds.is_empty() && !terminal_inside && !clash
}

/// The namespaces whose two members in one group collide (H008):
/// terminals are kept apart by H006/H007 instead.
const CLASHING: [Namespace; 2] = [Namespace::Mixer, Namespace::SelfAttention];

fn shares_checkpoint_keys(namespace: Namespace) -> bool {
    CLASHING.contains(&namespace)
}

fn bracketed(kinds: &[LayerKind]) -> String {
    let symbols: String = kinds.iter().map(|k| k.symbol()).collect();
    format!("[{symbols}]")
}

/// H009: `*` together with `+` or `D` anywhere in the model.
fn check_attention_families(pattern: &Pattern, out: &mut Findings) {
    let all = pattern
        .layers()
        .chain(pattern.mtp_depths.iter().flat_map(|d| &d.layers));
    let mut gqa: Option<&Layer> = None;
    let mut latent: Option<&Layer> = None;
    for layer in all {
        let (mine, other) = match layer.kind {
            LayerKind::Attention => (&mut gqa, latent),
            LayerKind::Mla | LayerKind::Dsa => (&mut latent, gqa),
            _ => continue,
        };
        if mine.is_none() {
            *mine = Some(layer);
            if let Some(other) = other {
                out.push(
                    Diagnostic::new(
                        Code::H009,
                        format!(
                            "`{}` ({}) in a model that already uses `{}` ({})",
                            layer.kind,
                            layer.kind.name(),
                            other.kind,
                            other.kind.name()
                        ),
                    )
                    .at(layer.span)
                    .label("second attention family")
                    .help("a model uses either GQA attention `*` or MLA-style attention (`+`, `D`), not both"),
                );
                return;
            }
        }
    }
}

/// H010: every MTP depth equal to the first. A depth that lost layers to a
/// syntax error is not compared (its error is already reported); the first
/// intact depth is the reference.
fn check_mtp_depths(pattern: &Pattern, lossy_depths: &[bool], out: &mut Findings) {
    let mut intact = pattern
        .mtp_depths
        .iter()
        .enumerate()
        .filter(|&(d, _)| !lossy_depths.get(d).copied().unwrap_or(false));
    let Some((r, first)) = intact.next() else {
        return;
    };
    let symbols = |layers: &[Layer]| layers.iter().map(|l| l.kind.symbol()).collect::<String>();
    let reference = symbols(&first.layers);
    for (d, depth) in intact {
        let this = symbols(&depth.layers);
        if this != reference {
            let shown = |s: &str| {
                if s.is_empty() {
                    "nothing".to_string()
                } else {
                    format!("`{}`", shorten(s, MAX_QUOTED))
                }
            };
            out.push(
                Diagnostic::new(
                    Code::H010,
                    format!(
                        "MTP depth {} is {} but depth {} is {}",
                        d + 1,
                        shown(&this),
                        r + 1,
                        shown(&reference)
                    ),
                )
                .at(depth.span)
                .label("differs from the first depth")
                .help(if this.is_empty() {
                    "remove the trailing `/`, or repeat the depth's layers after it".to_string()
                } else {
                    format!(
                        "every depth is built from one pattern: write `/{}` for each depth",
                        shorten(&reference, MAX_QUOTED)
                    )
                }),
            );
        }
    }
}
