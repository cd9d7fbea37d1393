//! Errors as data: a stable code, a message, the culprit's span, and a help
//! line. Rendered one way for a terminal (line:column and a caret) and another
//! for `compile_error!` (the pattern with a caret under the culprit).

use crate::span::{LineCol, Span};
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
}

impl Code {
    pub const ALL: [Code; 19] = [
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
                 1,000,000 layers. A block `( ... )` needs its count, and cannot\n\
                 appear inside a group or cross a `|` or `/`.\n\
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
                 dimensions must be even, DSA needs a q-LoRA rank."
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
    pub fn render(&self, source: &str, origin: &str) -> String {
        let mut out = format!("error[{}]: {}\n", self.code, self.message);
        if let Some(span) = self.span {
            let at = span.line_col(source);
            let line_text = source.lines().nth(at.line - 1).unwrap_or("");
            let gutter = at.line.to_string().len();
            let pad = " ".repeat(gutter);
            out += &format!("{pad}--> {origin}:{at}\n");
            out += &format!("{pad} |\n");
            out += &format!("{} | {}\n", at.line, line_text);
            out += &format!(
                "{pad} | {}{} {}\n",
                caret_indent(line_text, at),
                "^".repeat(caret_width(source, span, line_text, at)),
                self.label
            );
        }
        if !self.help.is_empty() {
            let pad = " ".repeat(
                self.span
                    .map_or(0, |s| s.line_col(source).line.to_string().len()),
            );
            out += &format!("{pad} = help: {}\n", self.help);
        }
        out
    }

    /// The form for a `compile_error!` message, where only the message text
    /// reaches the user: the code, the pattern with a caret under the culprit,
    /// and the help.
    pub fn render_inline(&self, source: &str) -> String {
        let mut out = format!("[{}] {}", self.code, self.message);
        if let Some(span) = self.span {
            let at = span.line_col(source);
            let line_text = source.lines().nth(at.line - 1).unwrap_or("");
            out += &format!(
                "\n  at {at}:\n    {line_text}\n    {}{} {}",
                caret_indent(line_text, at),
                "^".repeat(caret_width(source, span, line_text, at)),
                self.label
            );
        }
        if !self.help.is_empty() {
            out += &format!("\n  help: {}", self.help);
        }
        out
    }
}

/// White space up to the caret's column: a tab where the line has a tab, so
/// the caret lines up in a terminal whatever its tab width.
fn caret_indent(line_text: &str, at: LineCol) -> String {
    line_text
        .chars()
        .chain(std::iter::repeat(' '))
        .take(at.column - 1)
        .map(|c| if c == '\t' { '\t' } else { ' ' })
        .collect()
}

/// Carets under the span's characters, at least one, not past the line end.
fn caret_width(source: &str, span: Span, line_text: &str, at: LineCol) -> usize {
    let end = span.end.min(source.len());
    let start = span.start.min(end);
    let chars = source
        .get(start..end)
        .map_or(1, |text| text.chars().take_while(|&c| c != '\n').count());
    let room = line_text.chars().count().saturating_sub(at.column - 1);
    chars.clamp(1, room.max(1))
}

/// Every diagnostic of one input, with the text they point into, so the whole
/// report can be printed from the error value alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostics {
    pub source: String,
    /// What the source is, for `--> origin:line:col` (e.g. `pattern`).
    pub origin: String,
    pub items: Vec<Diagnostic>,
}

impl Diagnostics {
    pub fn new(
        source: impl Into<String>,
        origin: impl Into<String>,
        items: Vec<Diagnostic>,
    ) -> Self {
        Diagnostics {
            source: source.into(),
            origin: origin.into(),
            items,
        }
    }

    pub fn codes(&self) -> Vec<Code> {
        self.items.iter().map(|d| d.code).collect()
    }

    /// `(code, line:column)` of every diagnostic that points into the source.
    pub fn positions(&self) -> Vec<(Code, Option<LineCol>)> {
        self.items
            .iter()
            .map(|d| (d.code, d.position(&self.source)))
            .collect()
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, diagnostic) in self.items.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}", diagnostic.render(&self.source, &self.origin))?;
        }
        let n = self.items.len();
        if n > 1 {
            write!(f, "\n{n} errors")?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

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
