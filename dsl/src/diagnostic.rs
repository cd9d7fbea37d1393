//! Errors as data: a stable code, a message, the culprit's span, and a help
//! line. Rendered one way for a terminal (line:column and a caret) and another
//! for `compile_error!` (the pattern with a caret under the culprit).

use crate::span::{LineCol, LineIndex, Span};
use serde::Serialize;
use std::fmt;

/// Every rule hybridgen checks, with its stable code. Codes may have gaps and
/// are never reused: tests, docs and users' scripts refer to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Code {
    H001,
    H002,
    H003,
    H004,
    H005,
    H006,
    H007,
    H008,
    H009,
    H010,
    H011,
    H012,
    H020,
    H021,
    H022,
    H023,
    H025,
    H026,
    H027,
    H028,
}

impl Code {
    pub const ALL: [Code; 20] = [
        Code::H001,
        Code::H002,
        Code::H003,
        Code::H004,
        Code::H005,
        Code::H006,
        Code::H007,
        Code::H008,
        Code::H009,
        Code::H010,
        Code::H011,
        Code::H012,
        Code::H020,
        Code::H021,
        Code::H022,
        Code::H023,
        Code::H025,
        Code::H026,
        Code::H027,
        Code::H028,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Code::H001 => "H001",
            Code::H002 => "H002",
            Code::H003 => "H003",
            Code::H004 => "H004",
            Code::H005 => "H005",
            Code::H006 => "H006",
            Code::H007 => "H007",
            Code::H008 => "H008",
            Code::H009 => "H009",
            Code::H010 => "H010",
            Code::H011 => "H011",
            Code::H012 => "H012",
            Code::H020 => "H020",
            Code::H021 => "H021",
            Code::H022 => "H022",
            Code::H023 => "H023",
            Code::H025 => "H025",
            Code::H026 => "H026",
            Code::H027 => "H027",
            Code::H028 => "H028",
        }
    }

    /// Reads `H005`, `h005` or `5`.
    pub fn parse(text: &str) -> Option<Code> {
        let text = text.trim();
        let digits = text
            .strip_prefix('H')
            .or_else(|| text.strip_prefix('h'))
            .unwrap_or(text);
        let number: u32 = digits.parse().ok()?;
        Code::ALL
            .into_iter()
            .find(|code| code.as_str()[1..].parse::<u32>() == Ok(number))
    }

    /// The rule in a few words.
    pub fn title(self) -> &'static str {
        match self {
            Code::H001 => "unknown layer symbol",
            Code::H002 => "unclosed group",
            Code::H003 => "`]` closes nothing",
            Code::H004 => "empty group",
            Code::H005 => "nested group",
            Code::H006 => "`E` must be the last layer of its group",
            Code::H007 => "a group's dense MLP must be its only terminal and come last",
            Code::H008 => "two members of a group publish the same checkpoint names",
            Code::H009 => "GQA attention `*` mixed with MLA `+` or DSA `D`",
            Code::H010 => "multi-token-prediction depths differ",
            Code::H011 => "`|` or brackets in a multi-token-prediction depth",
            Code::H012 => "malformed repeat",
            Code::H020 => "pipeline segments do not divide over the pipeline stages",
            Code::H021 => "layers cannot be split evenly over the pipeline stages",
            Code::H022 => "`|` together with explicit first/last stage layer counts",
            Code::H023 => "parallel sizes do not fit the model",
            Code::H025 => "model dimensions that cannot work",
            Code::H026 => "a layer kind without dimensions",
            Code::H027 => "ambiguous FSDP unit filter",
            Code::H028 => "a model without layers",
        }
    }

    /// What the rule means and how to fix a pattern that breaks it, for
    /// `hybridgen explain`.
    pub fn explanation(self) -> &'static str {
        match self {
            Code::H001 => {
                "A pattern names one layer per character. The symbols are:\n\
                 \n  M  Mamba-2 mixer            -  dense MLP\n  *  self-attention (GQA)      E  mixture of experts\n  +  multi-latent attention   D  DeepSeek sparse attention\n  G  gated delta net\n\
                 \nStructure: `[ ]` a group, `|` a pipeline segment boundary, `/` a\n\
                 multi-token-prediction depth, `( ){N}` and `X{N}` repeats.\n\
                 \nExample: `M*x` fails at 1:3; `x` is probably `*` (attention): `M**`.\n\
                 Symbols are case-sensitive: write `M`, not `m`."
            }
            Code::H002 => {
                "Every `[` needs a `]` in the same pipeline segment. A group is one\n\
                 nested stack, so it can neither span a `|` (two pipeline stages)\n\
                 nor run into the `/` that starts a multi-token-prediction depth.\n\
                 \nExamples: `M[M*` (no `]`), `[M|E]` and `[M/E]` (the `]` comes after\n\
                 the segment ends). Fix: close the group before the boundary, e.g.\n\
                 `[M]|[E]` or `[ME]|...`."
            }
            Code::H003 => {
                "A `]` appeared where no group was open.\n\
                 \nExample: `M*]E` fails at 1:3. Remove the `]`, or add the missing\n\
                 `[` where the group should start: `[M*]E`."
            }
            Code::H004 => {
                "A group must hold at least one layer: `[]` builds an empty nested\n\
                 stack, which Megatron rejects.\n\
                 \nExample: `M[]` fails at 1:2. Remove the brackets or put layers in them."
            }
            Code::H005 => {
                "Groups do not nest: a group is one flat nested stack of layers.\n\
                 \nExample: `M[[M]]` fails at 1:3. Write the inner layers into the\n\
                 outer group (`M[M]`) or make them separate groups (`[M][*E]`)."
            }
            Code::H006 => {
                "A mixture-of-experts layer `E` is a group's terminal: the overlap\n\
                 schedule cuts a group into pre-dispatch work, the expert all-to-all\n\
                 and the experts, so the `E` must be the group's last member.\n\
                 \nExample: `M[EM]` fails at 1:3. Move the `E` last: `M[ME]`, or split\n\
                 the group: `M[E]M`."
            }
            Code::H007 => {
                "A dense MLP `-` is a terminal too (it runs in the schedule's mlp\n\
                 slot), so it must be its group's last member and a group can have\n\
                 only one terminal (`-` or `E`). Megatron accepts these patterns and\n\
                 fails only when the overlap schedule first runs them.\n\
                 \nExamples: `[-*]` (the `-` is not last), `[-E]`, `[--]` (two\n\
                 terminals). Fix: `[*-]`, or split: `[-][*E]`."
            }
            Code::H008 => {
                "Checkpoint keys flatten groups: every member of the group at\n\
                 logical index L publishes under `decoder.layers.L.`, so `[*-]` looks\n\
                 like one GPT layer. Two members of one namespace would then write\n\
                 the same keys (Megatron writes them silently and the second\n\
                 overwrites the first). The namespaces are: `mixer.` (M), and\n\
                 `self_attention.` (the attention family * + D G).\n\
                 \nExamples: `[**E]` fails at the second `*`, `[MM]` at the second `M`.\n\
                 Fix: split the group: `[*][*E]`, `M[M]`."
            }
            Code::H009 => {
                "GQA attention `*` and multi-latent attention (`+`, or `D` which is\n\
                 MLA plus an indexer) configure the model's one attention block in\n\
                 incompatible ways; Megatron builds either, not both. The rule spans\n\
                 the whole model, groups and multi-token-prediction depths included.\n\
                 \nExample: `M*M+` fails at 1:4. Use one family throughout."
            }
            Code::H010 => {
                "Every multi-token-prediction depth is built from the same pattern,\n\
                 so all depths after `/` must be identical. `main/` and `main//` (only\n\
                 empty depths) mean no MTP, but an empty depth after real ones is a\n\
                 mistake.\n\
                 \nExamples: `M*/ME/M` fails at the second depth; so does `M*/ME/`.\n\
                 Fix: `M*/ME/ME`."
            }
            Code::H011 => {
                "A multi-token-prediction depth is a plain run of layers: it lives on\n\
                 the last pipeline stage and is one stack of its own, so it takes\n\
                 neither `|` nor brackets.\n\
                 \nExample: `M*/[ME]` fails at 1:4. Fix: `M*/ME`."
            }
            Code::H012 => {
                "Repeats are sugar: `X{N}` repeats one item (a layer or a group) and\n\
                 `( items ){N}` repeats a run of items, inside one segment. N is a\n\
                 whole number from 1 to 100000, and a pattern may expand to at most\n\
                 1,000,000 layers, and its text may be at most 1 MiB (1048576\n\
                 bytes): write long runs with repeats. A block `( ... )` needs its\n\
                 count, and cannot appear inside a group or cross a `|` or `/`.\n\
                 \nExamples: `(M[*E]){4}` is `M[*E]M[*E]M[*E]M[*E]`. `M{0}`, `M{x}`,\n\
                 `{3}M`, `(M*)` and `(M|*){2}` fail."
            }
            Code::H020 => {
                "With `|`, each segment is one (virtual) pipeline stage: segment s\n\
                 runs on pipeline rank s % pp in virtual stage s / pp. The number of\n\
                 segments must therefore be a multiple of the pipeline size.\n\
                 \nExample: `M*|M*|M*` with pp 2 fails (3 segments). Add or remove a\n\
                 `|` (segments may be empty), or change --pp."
            }
            Code::H021 => {
                "Without `|`, the layers are split evenly over pp stages (after any\n\
                 explicit first/last stage counts). The physical layer count must\n\
                 divide evenly, and no stage boundary may cut a group, since a group\n\
                 is one nested stack built on one stage.\n\
                 \nExample: `[M*][M*]M` with pp 2 fails (5 layers); `M[*E]-` with pp 2\n\
                 cuts the group. Fix: place stage boundaries yourself with `|`\n\
                 around groups: `M[*E]|-`... or change --pp."
            }
            Code::H022 => {
                "`|` places every stage boundary itself, so explicit first/last\n\
                 stage layer counts would contradict it. Give one or the other."
            }
            Code::H023 => {
                "Expert parallelism splits each MoE layer's experts over `ep` ranks,\n\
                 and expert parameters are sharded over the remaining\n\
                 expert-data-parallel group of dp / ep ranks. So the expert count\n\
                 must be a multiple of ep, and the data-parallel size a multiple of\n\
                 ep. Every parallel size must be at least 1.\n\
                 \nExample: 6 experts with --ep 4 fails; --dp 6 --ep 4 fails."
            }
            Code::H025 => {
                "The model dimensions cannot build the layers: attention heads must\n\
                 divide the hidden size (when no head dimension is given), KV groups\n\
                 must divide the heads, Mamba heads must divide into its groups and\n\
                 heads x head dim must equal the inner size when both are given,\n\
                 top-k cannot exceed the expert count, no size may be zero, rotary\n\
                 dimensions must be even, DSA needs a q-LoRA rank.\n\
                 \nReal-valued fields must be finite numbers in range: `init_std` above\n\
                 0, `rope_base` (attention and MLA) above 1, `moe.aux_loss_coeff` and\n\
                 `mtp.loss_scale` at least 0. TOML can write `nan` and `inf`; neither\n\
                 is accepted."
            }
            Code::H026 => {
                "The pattern uses a layer kind whose section the model config does\n\
                 not have (e.g. `E` without `[moe]`), so the layer has no shapes.\n\
                 Add the section to the model file, or pick a preset that has it\n\
                 (`tiny` has dimensions for all seven kinds)."
            }
            Code::H027 => {
                "One unit filter decides which modules are FSDP units. A kind list\n\
                 is shorthand for a filter, so giving both a kind list and a custom\n\
                 predicate is ambiguous. Kind names are the layer symbols\n\
                 (M * + D G - E), `group` and `mtp`."
            }
            Code::H028 => {
                "A pattern with no layers at all (empty, or `|` or `/` alone) is valid, so\n\
                 `hybridgen check` accepts it, but it describes a model of only the\n\
                 embedding and the output layer: there is nothing to plan or train,\n\
                 and an empty pattern is almost always an unset variable or a lost\n\
                 argument. A model needs at least one layer, in the decoder or in a\n\
                 multi-token-prediction depth (`/MM` has no decoder layers and plans).\n\
                 \nExample: `hybridgen plan ''` fails. Fix: give the layers, e.g.\n\
                 `M[*E]M[*E]`."
            }
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One mistake: what is wrong (`message`), where (`span`, into the pattern
/// text, when the culprit is in the pattern), and how to fix it (`help`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    pub code: Code,
    pub message: String,
    pub span: Option<Span>,
    /// A short note printed beside the caret.
    pub label: String,
    pub help: String,
}

impl Diagnostic {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Diagnostic {
            code,
            message: message.into(),
            span: None,
            label: String::new(),
            help: String::new(),
        }
    }

    pub fn at(mut self, span: Span) -> Self {
        self.span = Some(span);
        self
    }

    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = help.into();
        self
    }

    /// Where the culprit starts in `source`, if the diagnostic points into it.
    pub fn position(&self, source: &str) -> Option<LineCol> {
        self.span.map(|span| span.line_col(source))
    }

    /// The terminal form:
    ///
    /// ```text
    /// error[H005]: nested group: a `[` inside the group opened at 1:2
    ///  --> pattern:1:3
    ///   |
    /// 1 | M[[M]]
    ///   |   ^ groups cannot contain groups
    ///   = help: ...
    /// ```
    ///
    /// A line longer than [`EXCERPT_WIDTH`] characters is shown as a window
    /// around the culprit, `...` marking the cut sides.
    pub fn render(&self, source: &str, origin: &str) -> String {
        self.render_at(source, origin, self.position(source))
    }

    /// [`Diagnostic::render`] with the culprit's position already known.
    fn render_at(&self, source: &str, origin: &str, at: Option<LineCol>) -> String {
        let mut out = format!("error[{}]: {}\n", self.code, bounded(&self.message));
        let gutter = at.map_or(0, |at| at.line.to_string().len());
        let pad = " ".repeat(gutter);
        if let (Some(span), Some(at)) = (self.span, at) {
            let excerpt = Excerpt::of(source, span, at);
            out += &format!("{pad}--> {}:{at}\n", bounded(origin));
            out += &format!("{pad} |\n");
            out += &format!("{} | {}\n", at.line, excerpt.line());
            out += &format!(
                "{pad} | {}{} {}\n",
                excerpt.caret_indent(),
                "^".repeat(excerpt.carets),
                bounded(&self.label)
            );
        }
        if !self.help.is_empty() {
            out += &format!("{pad} = help: {}\n", bounded(&self.help));
        }
        out
    }

    /// The form for a `compile_error!` message, where only the message text
    /// reaches the user: the code, the pattern with a caret under the culprit,
    /// and the help. Long lines are cut around the culprit as in
    /// [`Diagnostic::render`].
    pub fn render_inline(&self, source: &str) -> String {
        let mut out = format!("[{}] {}", self.code, bounded(&self.message));
        if let Some(span) = self.span {
            let at = span.line_col(source);
            let excerpt = Excerpt::of(source, span, at);
            out += &format!(
                "\n  at {at}:\n    {}\n    {}{} {}",
                excerpt.line(),
                excerpt.caret_indent(),
                "^".repeat(excerpt.carets),
                bounded(&self.label)
            );
        }
        if !self.help.is_empty() {
            out += &format!("\n  help: {}", bounded(&self.help));
        }
        out
    }
}

/// The most characters of a source line a rendering shows: a longer line is
/// cut to a window around the culprit, so a 10 MB one-line pattern still
/// renders each error in a few lines of ordinary length.
pub const EXCERPT_WIDTH: usize = 100;
/// Characters kept before the culprit when a long line is cut.
const EXCERPT_LEAD: usize = 40;
/// The most characters of a message, label or help a rendering shows. Ours
/// are short; the cap holds for any that quotes user input at length.
const MAX_TEXT: usize = 500;

/// `text`, or its first [`MAX_TEXT`] characters and `...`.
fn bounded(text: &str) -> std::borrow::Cow<'_, str> {
    shorten(text, MAX_TEXT)
}

/// `text`, or its first `max` characters followed by `...`: for quoting user
/// input (a repeat count, a run of symbols) in a message of bounded length.
pub fn shorten(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}...", &text[..cut]).into(),
        None => text.into(),
    }
}

/// The part of the culprit's line a rendering shows: the whole line when it
/// has at most [`EXCERPT_WIDTH`] characters, else a window of that many
/// starting [`EXCERPT_LEAD`] characters before the culprit. Finding it reads
/// only the window, never the whole line.
struct Excerpt<'s> {
    /// The shown characters (no line break).
    text: &'s str,
    /// The shown characters before the culprit.
    lead: &'s str,
    /// Whether the line goes on before / after the shown text.
    cut_before: bool,
    cut_after: bool,
    /// Carets under the culprit: at least one, none past the shown text.
    carets: usize,
}

impl<'s> Excerpt<'s> {
    fn of(source: &'s str, span: Span, at: LineCol) -> Excerpt<'s> {
        let mut start = span.start.min(source.len());
        while !source.is_char_boundary(start) {
            start -= 1;
        }
        // `at` says how many characters of the line precede the culprit.
        let before = at.column - 1;
        // The byte offset `n` characters before `start` (all on its line).
        let back = |n: usize| {
            source[..start]
                .char_indices()
                .rev()
                .take(n)
                .last()
                .map_or(start, |(i, _)| i)
        };
        // From `from`, up to `n` characters of the line: where they end, and
        // whether the line goes on after them. `\r\n` ends a line as `\n` does.
        let ahead = |from: usize, n: usize| {
            let rest = &source[from..];
            for (k, (i, _)) in rest.char_indices().enumerate() {
                if rest[i..].starts_with('\n') || rest[i..].starts_with("\r\n") {
                    return (from + i, false);
                }
                if k == n {
                    return (from + i, true);
                }
            }
            (source.len(), false)
        };
        let whole_line = (before <= EXCERPT_WIDTH)
            .then(|| {
                let line_start = back(before);
                let (end, more) = ahead(line_start, EXCERPT_WIDTH);
                (!more).then_some((line_start, end))
            })
            .flatten();
        let (from, end, cut_before, cut_after) = match whole_line {
            Some((line_start, end)) => (line_start, end, false, false),
            None => {
                let lead = before.min(EXCERPT_LEAD);
                let from = back(lead);
                let (end, more) = ahead(from, EXCERPT_WIDTH);
                (from, end, before > lead, more)
            }
        };
        let text = &source[from..end];
        let lead = &source[from..start.max(from).min(from + text.len())];
        let room = text[lead.len()..].chars().count().max(1);
        let culprit = source
            .get(start..span.end.min(source.len()).max(start))
            .map_or(1, |c| {
                c.chars().take_while(|&c| c != '\n').take(room).count()
            });
        Excerpt {
            text,
            lead,
            cut_before,
            cut_after,
            carets: culprit.clamp(1, room),
        }
    }

    /// The shown line, `...` on the cut sides.
    fn line(&self) -> String {
        let mark = |cut: bool| if cut { "..." } else { "" };
        format!(
            "{}{}{}",
            mark(self.cut_before),
            self.text,
            mark(self.cut_after)
        )
    }

    /// White space up to the caret's column: a tab where the line has a tab,
    /// so the caret lines up in a terminal whatever its tab width.
    fn caret_indent(&self) -> String {
        let dots = if self.cut_before { "   " } else { "" };
        dots.chars()
            .chain(self.lead.chars())
            .map(|c| if c == '\t' { '\t' } else { ' ' })
            .collect()
    }
}

/// Every diagnostic of one input, with the text they point into, so the whole
/// report can be printed from the error value alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostics {
    pub source: String,
    /// What the source is, for `--> origin:line:col` (e.g. `pattern`).
    pub origin: String,
    /// The first [`Diagnostics::MAX_KEPT`] diagnostics found, in order.
    pub items: Vec<Diagnostic>,
    /// Diagnostics found beyond `items`: counted, not kept.
    pub omitted: usize,
}

impl Diagnostics {
    /// The most diagnostics kept for one input. A 10 MB pattern can hold ten
    /// million mistakes; keeping each would take gigabytes for a report
    /// that shows the first [`Diagnostics::MAX_RENDERED`].
    pub const MAX_KEPT: usize = 1000;
    /// The most diagnostics a report renders; it counts the rest.
    pub const MAX_RENDERED: usize = 50;

    /// Keeps the first [`Diagnostics::MAX_KEPT`] of `items` and counts the
    /// rest.
    pub fn new(
        source: impl Into<String>,
        origin: impl Into<String>,
        mut items: Vec<Diagnostic>,
    ) -> Self {
        let omitted = items.len().saturating_sub(Self::MAX_KEPT);
        items.truncate(Self::MAX_KEPT);
        Diagnostics {
            source: source.into(),
            origin: origin.into(),
            items,
            omitted,
        }
    }

    /// Every diagnostic found, kept or not.
    pub fn total(&self) -> usize {
        self.items.len() + self.omitted
    }

    pub fn codes(&self) -> Vec<Code> {
        self.items.iter().map(|d| d.code).collect()
    }

    /// `(code, line:column)` of every diagnostic that points into the source.
    pub fn positions(&self) -> Vec<(Code, Option<LineCol>)> {
        let lines = LineIndex::new(&self.source);
        self.items
            .iter()
            .map(|d| (d.code, d.span.map(|s| lines.line_col(s.start))))
            .collect()
    }
}

impl fmt::Display for Diagnostics {
    /// The first [`Diagnostics::MAX_RENDERED`] diagnostics, then how many
    /// more there are and the total.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = &self.items[..self.items.len().min(Self::MAX_RENDERED)];
        // With several positions to find, one pass over the source serves
        // them all.
        let spanned = shown.iter().filter(|d| d.span.is_some()).count();
        let lines = (spanned > 1).then(|| LineIndex::new(&self.source));
        for (i, diagnostic) in shown.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            let at = diagnostic.span.map(|span| match &lines {
                Some(lines) => lines.line_col(span.start),
                None => span.line_col(&self.source),
            });
            write!(
                f,
                "{}",
                diagnostic.render_at(&self.source, &self.origin, at)
            )?;
        }
        let total = self.total();
        let hidden = total - shown.len();
        if hidden > 0 {
            let s = if hidden == 1 { "" } else { "s" };
            write!(f, "\n... and {hidden} more error{s}")?;
        }
        if total > 1 {
            write!(f, "\n{total} errors")?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

/// Diagnostics as a check finds them: every one counted, the first
/// [`Diagnostics::MAX_KEPT`] kept. A diagnostic equal in code and place to
/// the one found just before it is a copy (a repeat writes its culprit many
/// times over) and is not counted again.
#[derive(Clone, Debug, Default)]
pub struct Findings {
    kept: Vec<Diagnostic>,
    omitted: usize,
    last: Option<(Code, Option<Span>)>,
}

impl Findings {
    pub fn push(&mut self, diagnostic: Diagnostic) {
        let key = (diagnostic.code, diagnostic.span);
        if self.last == Some(key) {
            return;
        }
        self.last = Some(key);
        if self.kept.len() < Diagnostics::MAX_KEPT {
            self.kept.push(diagnostic);
        } else {
            self.omitted += 1;
        }
    }

    /// How many were found, kept or not.
    pub fn total(&self) -> usize {
        self.kept.len() + self.omitted
    }

    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }

    /// The kept diagnostics, and how many more were found.
    pub fn into_parts(self) -> (Vec<Diagnostic>, usize) {
        (self.kept, self.omitted)
    }
}

impl Extend<Diagnostic> for Findings {
    fn extend<I: IntoIterator<Item = Diagnostic>>(&mut self, diagnostics: I) {
        for diagnostic in diagnostics {
            self.push(diagnostic);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_parse_in_every_spelling() {
        assert_eq!(Code::parse("H005"), Some(Code::H005));
        assert_eq!(Code::parse("h005"), Some(Code::H005));
        assert_eq!(Code::parse("5"), Some(Code::H005));
        assert_eq!(Code::parse("H024"), None);
        assert_eq!(Code::parse("banana"), None);
        for code in Code::ALL {
            assert_eq!(Code::parse(code.as_str()), Some(code));
            assert!(!code.explanation().is_empty());
        }
    }

    #[test]
    fn terminal_rendering_points_at_the_culprit() {
        let d = Diagnostic::new(Code::H005, "nested group")
            .at(Span::new(2, 3))
            .label("groups cannot contain groups")
            .help("flatten it");
        let text = d.render("M[[M]]", "pattern");
        assert_eq!(
            text,
            "error[H005]: nested group\n --> pattern:1:3\n  |\n1 | M[[M]]\n  |   ^ groups cannot contain groups\n  = help: flatten it\n"
        );
    }

    #[test]
    fn inline_rendering_carries_code_and_caret() {
        let d = Diagnostic::new(Code::H001, "unknown symbol `x`").at(Span::new(1, 2));
        assert_eq!(
            d.render_inline("Mx"),
            "[H001] unknown symbol `x`\n  at 1:2:\n    Mx\n     ^ "
        );
    }
}
