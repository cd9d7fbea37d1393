//! The `hybridgen` command line.

fn main() -> std::process::ExitCode {
    hybridgen::cli::run(std::env::args_os())
}
