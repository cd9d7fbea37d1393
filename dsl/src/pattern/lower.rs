//! From the tolerant parse tree to the expanded syntax tree.
//!
//! Lowering runs in two steps. First the parse tree becomes a compact tree in
//! which repeats are still counts, and every error node of the grammar becomes
//! a diagnostic. Then, if the expansion fits the layer budget, the repeats are
//! unrolled into a [`Pattern`]. Counting before unrolling is what keeps
//! `(M{100000}){100000}` an error instead of an out-of-memory.

use super::{
    Group, Item, Layer, LayerKind, MAX_EXPANDED_LAYERS, MAX_PATTERN_BYTES, MAX_REPEAT, MtpDepth,
    Pattern, Segment,
};
use crate::diagnostic::{Code, Diagnostic, Findings, shorten};
use crate::span::{LineCol, LineIndex, Span};
use pest::Parser;
use pest::iterators::Pair;

#[derive(pest_derive::Parser)]
#[grammar = "pattern/grammar.pest"]
struct PatternParser;

/// A pattern before its repeats are unrolled.
enum Node {
    Layer(Layer),
    Group {
        span: Span,
        members: Vec<(Layer, usize)>,
    },
    Repeat {
        body: Vec<Node>,
        times: usize,
    },
}

impl Node {
    /// Physical layers this node expands to (saturating: a count, not memory).
    fn size(&self) -> usize {
        match self {
            Node::Layer(_) => 1,
            Node::Group { members, .. } => members
                .iter()
                .map(|(_, n)| *n)
                .fold(0, usize::saturating_add),
            Node::Repeat { body, times } => body
                .iter()
                .map(Node::size)
                .fold(0, usize::saturating_add)
                .saturating_mul(*times),
        }
    }
}

/// Where an item is being read: the rules for brackets and `|` differ.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Main,
    Mtp,
}

struct Lowering<'s> {
    source: &'s str,
    /// Positions for messages that name another place (`the `|` at 1:9`),
    /// built on first use.
    lines: std::cell::OnceCell<LineIndex<'s>>,
    diagnostics: Findings,
    /// Diagnostics found of the kinds that drop layers (H001, H005, H012),
    /// counted whether kept or not, to tell which MTP depths lost layers.
    lossy_found: usize,
    /// Unclosed `[`s not yet matched with a later stray `]`. The first stray
    /// `]` after an unclosed group is taken as its intended closer (as in
    /// `[M|E]`) and not reported a second time.
    unmatched_unclosed: usize,
    /// The same for an unclosed `(` and a later stray `)`.
    unmatched_unclosed_paren: usize,
    /// Whether the source writes GQA attention (`*`) and the latent family
    /// (`+`, `D`): an unknown symbol is guessed to be the attention the
    /// pattern already uses, since a model has only one family (H009).
    writes_gqa: bool,
    writes_latent: bool,
}

/// A pattern as far as it could be read, and what reading it found.
pub(super) struct Lowered {
    /// Everything that could be read, so the semantic rules can still run on
    /// it and report their own independent errors.
    pub pattern: Pattern,
    /// The syntax diagnostics (H001-H005, H011, H012).
    pub diagnostics: Findings,
    /// Per MTP depth of `pattern`: whether a syntax error dropped some of its
    /// layers (an unknown symbol, a malformed repeat, a nested group), so
    /// comparing it with the other depths (H010) would report a cascade.
    pub lossy_depths: Vec<bool>,
}

/// Parses `source` into an expanded pattern plus the diagnostics of its
/// syntax.
pub(super) fn lower(source: &str) -> Lowered {
    let mut cx = Lowering {
        source,
        lines: std::cell::OnceCell::new(),
        diagnostics: Findings::default(),
        lossy_found: 0,
        unmatched_unclosed: 0,
        unmatched_unclosed_paren: 0,
        writes_gqa: source.contains('*'),
        writes_latent: source.contains(['+', 'D']),
    };
    let empty = Pattern {
        segments: Vec::new(),
        mtp_depths: Vec::new(),
    };
    if source.len() > MAX_PATTERN_BYTES {
        let mut cut = MAX_PATTERN_BYTES;
        while !source.is_char_boundary(cut) {
            cut -= 1;
        }
        let next = source[cut..].chars().next().map_or(1, char::len_utf8);
        cx.push(
            Diagnostic::new(
                Code::H012,
                format!(
                    "the pattern is {} bytes long, over the limit of {MAX_PATTERN_BYTES} (1 MiB)",
                    source.len()
                ),
            )
            .at(Span::new(cut, cut + next))
            .label("the pattern goes on past the limit here")
            .help("write long runs with repeats: `(M[*E]){1000}` is 6,000 characters in 12"),
        );
        return Lowered {
            pattern: empty,
            diagnostics: cx.diagnostics,
            lossy_depths: Vec::new(),
        };
    }
    if let Some(too_deep) = check_nesting(source, MAX_NESTING) {
        cx.diagnostics.push(too_deep);
        return Lowered {
            pattern: empty,
            diagnostics: cx.diagnostics,
            lossy_depths: Vec::new(),
        };
    }
    let root = match PatternParser::parse(Rule::pattern, source) {
        Ok(mut pairs) => pairs.next(),
        Err(error) => {
            // The grammar accepts every input (a property test holds it to
            // that); should it ever not, report rather than panic.
            let at = match error.location {
                pest::error::InputLocation::Pos(p) => p,
                pest::error::InputLocation::Span((s, _)) => s,
            };
            // The character there, whole (the span must end on a boundary).
            let end = source
                .get(at..)
                .and_then(|rest| rest.chars().next())
                .map_or(at, |c| at + c.len_utf8());
            cx.diagnostics.push(
                Diagnostic::new(Code::H001, "the pattern could not be read here")
                    .at(Span::new(at, end))
                    .help("please report this pattern: every input should parse"),
            );
            None
        }
    };
    let Some(root) = root else {
        return Lowered {
            pattern: empty,
            diagnostics: cx.diagnostics,
            lossy_depths: Vec::new(),
        };
    };

    let mut segments = Vec::new();
    let mut depths = Vec::new();
    for pair in root.into_inner() {
        match pair.as_rule() {
            Rule::main => {
                for part in pair.into_inner() {
                    if part.as_rule() == Rule::segment {
                        let span = span_of(&part);
                        let mut nodes = Vec::new();
                        for item in part.into_inner() {
                            cx.item(item, Place::Main, &mut nodes);
                        }
                        segments.push((span, nodes));
                    }
                }
            }
            Rule::mtp_depth => {
                let span = span_of(&pair);
                let lossy_before = cx.lossy_found;
                let mut nodes = Vec::new();
                for part in pair.into_inner() {
                    match part.as_rule() {
                        Rule::mtp_open => {}
                        Rule::mtp_pipe => cx.push(
                            Diagnostic::new(
                                Code::H011,
                                "`|` inside a multi-token-prediction depth",
                            )
                            .at(span_of(&part))
                            .label("pipeline boundaries belong to the main pattern")
                            .help("MTP depths run on the last pipeline stage; remove the `|`"),
                        ),
                        Rule::item => cx.item(part, Place::Mtp, &mut nodes),
                        _ => {}
                    }
                }
                let lossy = cx.lossy_found > lossy_before;
                depths.push((span, nodes, lossy));
            }
            _ => {}
        }
    }

    let total = segments
        .iter()
        .flat_map(|(_, nodes)| nodes)
        .chain(depths.iter().flat_map(|(_, nodes, _)| nodes))
        .map(Node::size)
        .fold(0, usize::saturating_add);
    if total > MAX_EXPANDED_LAYERS {
        cx.push(
            Diagnostic::new(
                Code::H012,
                format!(
                    "the pattern expands to {total} layers, over the limit of {MAX_EXPANDED_LAYERS}"
                ),
            )
            .at(Span::new(0, source.len()))
            .label("expands too far")
            .help("use smaller repeat counts"),
        );
        return Lowered {
            pattern: empty,
            diagnostics: cx.diagnostics,
            lossy_depths: Vec::new(),
        };
    }

    let lossy_depths = depths.iter().map(|&(_, _, lossy)| lossy).collect();
    let pattern = Pattern {
        segments: segments
            .into_iter()
            .map(|(span, nodes)| Segment {
                items: expand(&nodes),
                span,
            })
            .collect(),
        mtp_depths: depths
            .into_iter()
            .map(|(span, nodes, _)| MtpDepth {
                layers: expand(&nodes)
                    .iter()
                    .flat_map(|i| i.layers().to_vec())
                    .collect(),
                span,
            })
            .collect(),
    };
    let (pattern, lossy_depths) = drop_empty_mtp(pattern, lossy_depths);
    Lowered {
        pattern,
        diagnostics: cx.diagnostics,
        lossy_depths,
    }
}

/// `main/` and `main//` mean no MTP. Depths that differ (an empty one among
/// real ones included) are kept for the H010 rule.
fn drop_empty_mtp(mut pattern: Pattern, mut lossy: Vec<bool>) -> (Pattern, Vec<bool>) {
    if pattern.mtp_depths.iter().all(|d| d.layers.is_empty()) {
        pattern.mtp_depths.clear();
        lossy.clear();
    }
    (pattern, lossy)
}

/// How deep `[` and `(` may nest. The parser and the lowering recurse once
/// per level, so without a bound a long run of `(` overflows the stack (an
/// abort, not an error). Real patterns nest two or three levels, and twenty
/// nested repeats of two already pass [`MAX_EXPANDED_LAYERS`].
pub(super) const MAX_NESTING: usize = 64;

/// Follows the grammar's nesting of groups and blocks over the structure
/// characters alone (counts and symbols never nest) and reports the first
/// opener past `limit` levels.
fn check_nesting(source: &str, limit: usize) -> Option<Diagnostic> {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Open {
        /// `[` outside any block: ends at its `]`, or unclosed at `|`, `/`
        /// or the end; a `)` inside it is a stray.
        Group,
        /// `[` inside a block: as a group, but also unclosed at a `)`.
        BlockGroup,
        /// `(` outside a group: ends at its `)`, or unclosed at `|`, `/` or
        /// the end; a `]` inside it is a stray.
        Block,
        /// `(` inside a group: ends at its `)`, or before a `]`, `|` or `/`.
        ParenInGroup,
    }
    let mut stack: Vec<Open> = Vec::new();
    for (at, c) in source.char_indices() {
        match c {
            '[' => stack.push(match stack.last() {
                None | Some(Open::Group) => Open::Group,
                Some(_) => Open::BlockGroup,
            }),
            '(' => stack.push(match stack.last() {
                Some(Open::Group | Open::BlockGroup | Open::ParenInGroup) => Open::ParenInGroup,
                _ => Open::Block,
            }),
            ']' => {
                while let Some(&top) = stack.last() {
                    match top {
                        Open::Block => break,
                        Open::Group | Open::BlockGroup => {
                            stack.pop();
                            break;
                        }
                        Open::ParenInGroup => {
                            stack.pop();
                        }
                    }
                }
            }
            ')' => {
                while let Some(&top) = stack.last() {
                    match top {
                        Open::Group => break,
                        Open::BlockGroup => {
                            stack.pop();
                        }
                        Open::Block | Open::ParenInGroup => {
                            stack.pop();
                            break;
                        }
                    }
                }
            }
            '|' | '/' => stack.clear(),
            _ => continue,
        }
        if stack.len() > limit {
            let in_group = stack[..stack.len() - 1].iter().any(|&o| o != Open::Block);
            let (code, what) = if c == '[' && in_group {
                (Code::H005, "nested group")
            } else {
                (Code::H012, "repeat blocks")
            };
            return Some(
                Diagnostic::new(
                    code,
                    format!("{what}: brackets and parentheses nest more than {limit} levels deep here"),
                )
                .at(Span::new(at, at + 1))
                .label("too deep")
                .help("a group holds plain layers, and a few levels of `( ){N}` reach any size: flatten the nesting"),
            );
        }
    }
    None
}

fn expand(nodes: &[Node]) -> Vec<Item> {
    // Every item has at least one layer, so the layer count (within budget,
    // checked before expanding) bounds the item count.
    let layers = nodes.iter().map(Node::size).fold(0, usize::saturating_add);
    let mut out = Vec::with_capacity(layers);
    expand_into(nodes, &mut out);
    out
}

fn expand_into(nodes: &[Node], out: &mut Vec<Item>) {
    for node in nodes {
        match node {
            Node::Layer(layer) => out.push(Item::Layer(*layer)),
            Node::Group { span, members } => out.push(Item::Group(Group {
                span: *span,
                members: members
                    .iter()
                    .flat_map(|(layer, n)| std::iter::repeat_n(*layer, *n))
                    .collect(),
            })),
            Node::Repeat { body, times } => {
                let start = out.len();
                expand_into(body, out);
                let once = out.len() - start;
                for _ in 1..*times {
                    out.extend_from_within(start..start + once);
                }
            }
        }
    }
}

/// The most characters of user input a message quotes.
const MAX_QUOTED: usize = 24;

fn span_of(pair: &Pair<'_, Rule>) -> Span {
    let s = pair.as_span();
    Span::new(s.start(), s.end())
}

impl Lowering<'_> {
    fn push(&mut self, diagnostic: Diagnostic) {
        if matches!(diagnostic.code, Code::H001 | Code::H005 | Code::H012) {
            self.lossy_found += 1;
        }
        self.diagnostics.push(diagnostic);
    }

    fn at(&self, offset: usize) -> LineCol {
        self.lines
            .get_or_init(|| LineIndex::new(self.source))
            .line_col(offset)
    }

    /// One `item` / `block_item`: an atom and its optional count, appended
    /// to `out`.
    fn item(&mut self, pair: Pair<'_, Rule>, place: Place, out: &mut Vec<Node>) {
        let mut inner = pair.into_inner();
        let Some(atom) = inner.next() else {
            return;
        };
        let count = inner.next();
        let atom_span = span_of(&atom);
        let node = match atom.as_rule() {
            Rule::layers => {
                // A count repeats the run's last layer only: `MM{3}` is `MMMM`.
                let mut run = layers_of(&atom);
                let last = run.next_back();
                out.extend(run.map(Node::Layer));
                last.map(Node::Layer)
            }
            Rule::group | Rule::block_group => self.group(atom, place),
            Rule::repeat_block => {
                let (body, closed) = self.repeat_block(atom);
                if closed && count.is_none() {
                    self.push(
                        Diagnostic::new(Code::H012, "a parenthesised block needs a repeat count")
                            .at(atom_span)
                            .label("no `{N}` after this block")
                            .help("write the count after the block, e.g. `(M[*E]){4}`, or drop the parentheses"),
                    );
                }
                Some(Node::Repeat { body, times: 1 })
            }
            Rule::stray | Rule::block_stray => {
                self.stray(atom, place);
                None
            }
            _ => None,
        };
        let node = match (node, count) {
            (Some(node), Some(count)) => {
                let Some(times) = self.count(count, &node) else {
                    return;
                };
                Some(match node {
                    Node::Repeat { body, .. } => Node::Repeat { body, times },
                    node => Node::Repeat {
                        body: vec![node],
                        times,
                    },
                })
            }
            (node, Some(count)) => {
                // The atom was an error; still check the count itself.
                let _ = self.count_value(&count);
                node
            }
            (node, None) => node,
        };
        out.extend(node);
    }

    fn group(&mut self, pair: Pair<'_, Rule>, place: Place) -> Option<Node> {
        let span = span_of(&pair);
        let mut open = span;
        let mut members = Vec::new();
        let mut saw_member = false;
        let mut closed = false;
        let mut end = span.end;
        for part in pair.into_inner() {
            match part.as_rule() {
                Rule::group_open => open = span_of(&part),
                Rule::group_close => closed = true,
                Rule::unclosed | Rule::block_unclosed => end = span_of(&part).start,
                Rule::stray_paren => self.stray_paren(span_of(&part)),
                Rule::member | Rule::block_member => {
                    saw_member = true;
                    self.member(part, open, &mut members);
                }
                _ => {}
            }
        }
        if !closed {
            self.unmatched_unclosed += 1;
            let (before, why) = match self.source[end..].chars().next() {
                Some('|') => (
                    format!("the `|` at {}", self.at(end)),
                    "a group cannot span two pipeline segments",
                ),
                Some('/') => (
                    format!("the `/` at {}", self.at(end)),
                    "a group cannot run into a multi-token-prediction depth",
                ),
                Some(')') => (
                    format!("the `)` at {}", self.at(end)),
                    "a group cannot cross the end of a repeat block",
                ),
                _ => (
                    "the end of the pattern".to_string(),
                    "every `[` needs a `]`",
                ),
            };
            self.push(
                Diagnostic::new(
                    Code::H002,
                    format!("unclosed group: this `[` has no `]` before {before}"),
                )
                .at(open)
                .label("opened here")
                .help(format!("{why}; close the group before it")),
            );
        } else if !saw_member {
            self.push(
                Diagnostic::new(Code::H004, "empty group")
                    .at(span)
                    .label("a group needs at least one layer")
                    .help("remove the brackets, or put the layers to group inside them"),
            );
        }
        if place == Place::Mtp {
            self.push(
                Diagnostic::new(Code::H011, "brackets inside a multi-token-prediction depth")
                    .at(open)
                    .label("groups belong to the main pattern")
                    .help("an MTP depth is a plain run of layers; remove the brackets"),
            );
        }
        if place == Place::Mtp || !closed {
            // Keep the members as plain layers: an MTP depth can still be
            // compared with the others (H010), and an unclosed group, whose
            // extent is a guess, is not held to the group rules (H006-H008),
            // which would only report the missing `]` again.
            let body = members
                .into_iter()
                .map(|(layer, n)| Node::Repeat {
                    body: vec![Node::Layer(layer)],
                    times: n,
                })
                .collect();
            return Some(Node::Repeat { body, times: 1 });
        }
        if members.is_empty() {
            return None;
        }
        Some(Node::Group { span, members })
    }

    /// One `member` of a group: its layers and how many copies of each,
    /// appended to `out`.
    fn member(&mut self, pair: Pair<'_, Rule>, outer_open: Span, out: &mut Vec<(Layer, usize)>) {
        let mut inner = pair.into_inner();
        let Some(atom) = inner.next() else {
            return;
        };
        let count = inner.next();
        let layer = match atom.as_rule() {
            Rule::layers => {
                // A count repeats the run's last layer only.
                let mut run = layers_of(&atom);
                let last = run.next_back();
                out.extend(run.map(|layer| (layer, 1)));
                last
            }
            Rule::group | Rule::block_group => {
                let inner_open = Span::new(span_of(&atom).start, span_of(&atom).start + 1);
                self.push(
                    Diagnostic::new(
                        Code::H005,
                        format!("nested group: a `[` inside the group opened at {}", self.at(outer_open.start)),
                    )
                    .at(inner_open)
                    .label("groups cannot contain groups")
                    .help("a group is one flat stack: remove the inner brackets, or close the outer group first"),
                );
                // Read the inner group for its own mistakes, then drop it.
                let _ = self.group(atom, Place::Main);
                None
            }
            Rule::paren_in_group => {
                let mut dropped = Vec::new();
                for inner in atom.clone().into_inner() {
                    // Report what is wrong inside too; the members are dropped.
                    self.member(inner, outer_open, &mut dropped);
                }
                self.push(
                    Diagnostic::new(Code::H012, "a repeat block `( ){N}` inside a group")
                        .at(span_of(&atom))
                        .label("not allowed inside `[ ]`")
                        .help("write the members once and repeat the whole group, e.g. `[ME]{2}`: a group holds one layer of each kind"),
                );
                None
            }
            Rule::stray_in_group => {
                self.stray(atom, Place::Main);
                None
            }
            _ => None,
        };
        let times = match count {
            Some(count) => match self.count_value(&count) {
                Some(times) => times,
                None => return,
            },
            None => 1,
        };
        out.extend(layer.map(|layer| (layer, times)));
    }

    /// The block's items, and whether it was closed.
    fn repeat_block(&mut self, pair: Pair<'_, Rule>) -> (Vec<Node>, bool) {
        let mut open = span_of(&pair);
        let mut body = Vec::new();
        let mut closed = true;
        for part in pair.into_inner() {
            match part.as_rule() {
                Rule::paren_open => open = span_of(&part),
                Rule::block_item => self.item(part, Place::Main, &mut body),
                Rule::unclosed_paren => {
                    closed = false;
                    self.unmatched_unclosed_paren += 1;
                    let end = span_of(&part).start;
                    let before = match self.source[end..].chars().next() {
                        Some(c) => format!("the `{c}` at {}", self.at(end)),
                        None => "the end of the pattern".to_string(),
                    };
                    self.push(
                        Diagnostic::new(Code::H012, format!("unclosed repeat block: this `(` has no `)` before {before}"))
                            .at(open)
                            .label("opened here")
                            .help("a repeat block stays inside one segment: close it with `){N}` before `|` or `/`"),
                    );
                }
                _ => {}
            }
        }
        (body, closed)
    }

    /// A count after an atom; checks the expansion stays in budget.
    fn count(&mut self, pair: Pair<'_, Rule>, node: &Node) -> Option<usize> {
        let span = span_of(&pair);
        let times = self.count_value(&pair)?;
        let size = node.size().saturating_mul(times);
        if size > MAX_EXPANDED_LAYERS {
            self.push(
                Diagnostic::new(
                    Code::H012,
                    format!("this repeat expands to {size} layers, over the limit of {MAX_EXPANDED_LAYERS}"),
                )
                .at(span)
                .label("too many layers")
                .help("use a smaller count"),
            );
            return None;
        }
        Some(times)
    }

    /// The number inside `{...}`, or a diagnostic for a malformed count.
    fn count_value(&mut self, pair: &Pair<'_, Rule>) -> Option<usize> {
        let span = span_of(pair);
        let mut text = String::new();
        let mut closed = false;
        for part in pair.clone().into_inner() {
            match part.as_rule() {
                Rule::count_char => text.push_str(part.as_str()),
                Rule::count_close => closed = true,
                _ => {}
            }
        }
        // Quoted in the message, so cut short: the braces may hold megabytes.
        let shown = shorten(&text, MAX_QUOTED);
        let problem = if !closed {
            Some(format!("unclosed repeat count `{{{shown}`"))
        } else if text.is_empty() {
            Some("empty repeat count `{}`".to_string())
        } else if !text.bytes().all(|b| b.is_ascii_digit()) {
            Some(format!("repeat count `{shown}` is not a whole number"))
        } else {
            match text.parse::<usize>() {
                Ok(0) => Some("repeat count 0: a repeat writes at least one copy".to_string()),
                Ok(n) if n <= MAX_REPEAT => return Some(n),
                _ => Some(format!(
                    "repeat count {shown} is over the limit of {MAX_REPEAT}"
                )),
            }
        };
        self.push(
            Diagnostic::new(Code::H012, problem.unwrap_or_default())
                .at(span)
                .label("malformed repeat")
                .help(format!("write a count from 1 to {MAX_REPEAT} in braces right after an item, e.g. `M{{4}}` or `(M[*E]){{2}}`")),
        );
        None
    }

    fn stray(&mut self, pair: Pair<'_, Rule>, place: Place) {
        let Some(inner) = pair.into_inner().next() else {
            return;
        };
        let span = span_of(&inner);
        match inner.as_rule() {
            Rule::stray_close => {
                if self.unmatched_unclosed > 0 {
                    // Already reported as its group's H002.
                    self.unmatched_unclosed -= 1;
                } else if place == Place::Mtp {
                    self.push(
                        Diagnostic::new(Code::H011, "`]` inside a multi-token-prediction depth")
                            .at(span)
                            .label("brackets belong to the main pattern")
                            .help("an MTP depth is a plain run of layers; remove the `]`"),
                    );
                } else {
                    self.push(
                        Diagnostic::new(Code::H003, "`]` closes nothing")
                            .at(span)
                            .label("no group is open here")
                            .help("remove the `]`, or add the `[` where the group should start"),
                    );
                }
            }
            Rule::stray_paren => self.stray_paren(span),
            Rule::stray_count => self.push(
                Diagnostic::new(
                    Code::H012,
                    format!(
                        "repeat count `{}` with nothing to repeat",
                        shorten(inner.as_str().trim(), MAX_QUOTED)
                    ),
                )
                .at(span)
                .label("nothing before this count")
                .help("a count follows the item it repeats: `M{4}`, `[*E]{2}`, `(M*){3}`"),
            ),
            Rule::unknown => self.unknown(inner.as_str(), span),
            _ => {}
        }
    }

    /// A `)` with no block open, at the top of a segment or in a group.
    fn stray_paren(&mut self, span: Span) {
        if self.unmatched_unclosed_paren > 0 {
            // Already reported as its block's unclosed `(`.
            self.unmatched_unclosed_paren -= 1;
            return;
        }
        self.push(
            Diagnostic::new(Code::H012, "`)` closes no repeat block")
                .at(span)
                .label("no `(` is open here")
                .help("remove the `)`, or add the `(` where the repeated run starts: `(M*){2}`"),
        );
    }

    fn unknown(&mut self, text: &str, span: Span) {
        let c = text.chars().next().unwrap_or('?');
        // An attention guess follows the family the pattern writes; where it
        // writes both, either guess would mix them, so none is made.
        let (gqa, latent) = (self.writes_gqa, self.writes_latent);
        let guess = suggestion(c).and_then(|(symbol, why)| match symbol {
            '*' | '+' | 'D' if gqa && latent => None,
            '*' if latent => Some((
                '+',
                "multi-latent attention, the attention this pattern uses",
            )),
            '+' | 'D' if gqa => Some(('*', "self-attention, the attention this pattern uses")),
            _ => Some((symbol, why)),
        });
        let (message, help) = match guess {
            Some((symbol, why)) => (
                format!("unknown layer symbol `{}`", c.escape_debug()),
                format!("did you mean `{symbol}` ({why})?"),
            ),
            None if c.is_ascii_digit() => (
                format!("unexpected digit `{c}`"),
                "a repeat count goes in braces after the item: `M{3}`".to_string(),
            ),
            None => (
                format!("unknown layer symbol `{}`", c.escape_debug()),
                "layer symbols are M * + D G - E; structure is [ ] | / and ( ){N}".to_string(),
            ),
        };
        self.push(
            Diagnostic::new(Code::H001, message)
                .at(span)
                .label("not a layer symbol")
                .help(help),
        );
    }
}

/// The layers of a `layers` run, one per symbol.
fn layers_of<'p>(pair: &Pair<'p, Rule>) -> impl DoubleEndedIterator<Item = Layer> + 'p {
    let start = pair.as_span().start();
    pair.as_str().char_indices().map(move |(i, symbol)| Layer {
        // The grammar's `layers` rule matches exactly the seven symbols.
        kind: LayerKind::from_symbol(symbol).unwrap_or(LayerKind::Mamba),
        span: Span::new(start + i, start + i + symbol.len_utf8()),
    })
}

/// The symbol a user most likely meant, and why.
fn suggestion(c: char) -> Option<(char, &'static str)> {
    Some(match c {
        'm' => ('M', "Mamba; symbols are case-sensitive"),
        'e' => ('E', "mixture of experts; symbols are case-sensitive"),
        'd' => ('D', "DeepSeek sparse attention; symbols are case-sensitive"),
        'g' => ('G', "gated delta net; symbols are case-sensitive"),
        'x' | 'X' | 'a' | 'A' | '×' | '∗' => ('*', "self-attention"),
        '_' | '=' | '~' | '–' | '—' | '−' => ('-', "dense MLP"),
        'l' | 'L' => ('+', "multi-latent attention"),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// How deep groups and blocks nest in the parse tree itself.
    fn tree_depth(pair: Pair<'_, Rule>) -> usize {
        let here = usize::from(matches!(
            pair.as_rule(),
            Rule::group | Rule::block_group | Rule::repeat_block | Rule::paren_in_group
        ));
        here + pair.into_inner().map(tree_depth).max().unwrap_or(0)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The nesting check follows the grammar exactly: it fires at a limit
        /// precisely when the parse tree nests deeper than that limit.
        #[test]
        fn nesting_check_agrees_with_the_parse_tree(
            source in "[\\[\\]()|/M{}2 ]{0,40}",
            limit in 0usize..6,
        ) {
            let root = PatternParser::parse(Rule::pattern, &source)
                .expect("the grammar accepts every input")
                .next()
                .expect("one pattern");
            let depth = tree_depth(root);
            prop_assert_eq!(check_nesting(&source, limit).is_some(), depth > limit, "depth {}", depth);
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        for (source, code, column) in [
            ("(".repeat(100_000), Code::H012, MAX_NESTING + 1),
            ("[".repeat(100_000), Code::H005, MAX_NESTING + 1),
            ("(M".repeat(100_000), Code::H012, 2 * MAX_NESTING + 1),
            (
                format!("{}[", "(".repeat(MAX_NESTING)),
                Code::H012,
                MAX_NESTING + 1,
            ),
        ] {
            let (diagnostics, _) = lower(&source).diagnostics.into_parts();
            let found: Vec<_> = diagnostics
                .iter()
                .map(|d| (d.code, d.position(&source).map(|p| p.column)))
                .collect();
            assert_eq!(found, [(code, Some(column))]);
        }
        // At the limit itself the pattern is read as usual.
        let source = format!("{}M{}", "(".repeat(MAX_NESTING), "){2}".repeat(MAX_NESTING));
        assert!(check_nesting(&source, MAX_NESTING).is_none());
    }
}
