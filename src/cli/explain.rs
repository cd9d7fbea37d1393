//! `hybridgen explain CODE`.

use super::Failure;
use hybridgen_dsl::Code;

#[derive(clap::Args, Debug)]
pub(crate) struct ExplainArgs {
    /// An error code such as H005 (or h005, or 5).
    code: String,
}

pub(crate) fn run(args: &ExplainArgs) -> Result<(), Failure> {
    let Some(code) = Code::parse(&args.code) else {
        let known: Vec<&str> = Code::ALL.iter().map(|c| c.as_str()).collect();
        return Err(Failure::Message(format!(
            "`{}` is not a hybridgen error code; the codes are {}",
            args.code,
            known.join(", ")
        )));
    };
    super::emit(&format!(
        "{code}: {}\n\n{}\n",
        code.title(),
        code.explanation()
    ))
}
