//! The build-script side of code generation: a model file (the TOML the
//! command line reads) plus the layout choices the static tables depend on,
//! in; the same Rust module `model!` would generate, as formatted source
//! text, out. `hybridgen::build` writes it under `OUT_DIR` and tells cargo
//! when to run again.

use crate::fields::Resolved;
use crate::generate::{ModelSpec, generate, module_name};
use crate::validate::plan_options;
use hybridgen_dsl::config::{ConfigError, ModelConfig};
use hybridgen_dsl::diagnostic::{Code, Diagnostic, Diagnostics};
use hybridgen_dsl::plan::{DEFAULT_NON_UNIT_BUCKET_CAP, Plan, UnitKind};
use std::fmt;
use std::path::{Path, PathBuf};

/// One model file to generate a module from, with the layout choices the
/// static tables depend on (the file itself holds only the model).
#[derive(Clone, Debug)]
pub struct ModelFile {
    path: PathBuf,
    name: Option<String>,
    ep: usize,
    pp: usize,
    first_stage_layers: Option<usize>,
    last_stage_layers: Option<usize>,
    unit_kinds: Option<String>,
    non_unit_bucket_cap: usize,
}

/// A generated module: where to `include!` it from and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeneratedModule {
    /// The module's name (`tiny` for `models/tiny.toml`).
    pub module: String,
    /// The model struct's name (`Tiny`).
    pub name: String,
    /// Formatted Rust source: the module and a `use` of the model struct.
    pub source: String,
}

/// Why a model file could not be turned into a module.
#[derive(Debug)]
pub enum BuildError {
    /// The file could not be read or is not a model.
    Config(ConfigError),
    /// The model does not plan: every diagnostic, rendered for a terminal.
    Plan(Diagnostics),
    /// A layout choice given to the builder is wrong.
    Option(Diagnostic),
    /// The struct name is not a Rust identifier.
    Name(String),
    /// Writing the generated file failed.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The generated code did not parse (a bug in the generator).
    Generated(String),
    /// `OUT_DIR` is not set: not running inside a build script.
    NoOutDir,
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Config(e) => write!(f, "{e}"),
            BuildError::Plan(d) => write!(f, "{d}"),
            BuildError::Option(d) => write!(f, "{}", d.render("", "build option")),
            BuildError::Name(name) => write!(
                f,
                "`{name}` cannot name a model struct: use a Rust type name such as `Tiny`"
            ),
            BuildError::Io { path, source } => {
                write!(f, "cannot write {}: {source}", path.display())
            }
            BuildError::Generated(e) => write!(
                f,
                "hybridgen generated code that does not parse (please report this): {e}"
            ),
            BuildError::NoOutDir => f.write_str(
                "OUT_DIR is not set: hybridgen::build runs inside a build script (build.rs)",
            ),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Config(e) => Some(e),
            BuildError::Plan(d) => Some(d),
            BuildError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl ModelFile {
    /// A model file with the default layout choices: `ep` 1, no pipeline
    /// split, the default unit filter, the default non-unit bucket cap.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        ModelFile {
            path: path.into(),
            name: None,
            ep: 1,
            pp: 1,
            first_stage_layers: None,
            last_stage_layers: None,
            unit_kinds: None,
            non_unit_bucket_cap: DEFAULT_NON_UNIT_BUCKET_CAP,
        }
    }

    /// The model struct's name; by default the file stem in UpperCamelCase
    /// (`nemotron-nano-9b-v2.toml` -> `NemotronNano9bV2`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The expert-parallel size the expert buckets are planned for.
    pub fn ep(mut self, ep: usize) -> Self {
        self.ep = ep;
        self
    }

    /// The pipeline-parallel size the stages are planned for.
    pub fn pp(mut self, pp: usize) -> Self {
        self.pp = pp;
        self
    }

    pub fn first_stage_layers(mut self, layers: usize) -> Self {
        self.first_stage_layers = Some(layers);
        self
    }

    pub fn last_stage_layers(mut self, layers: usize) -> Self {
        self.last_stage_layers = Some(layers);
        self
    }

    /// The FSDP unit-kind shorthand, as the command line writes it:
    /// `"group,E"` (layer symbols, `group`, `mtp`).
    pub fn unit_kinds(mut self, kinds: impl Into<String>) -> Self {
        self.unit_kinds = Some(kinds.into());
        self
    }

    pub fn non_unit_bucket_cap(mut self, elements: usize) -> Self {
        self.non_unit_bucket_cap = elements;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model struct's name this file generates.
    pub fn struct_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            let stem = self
                .path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            upper_camel(&stem)
        })
    }

    /// Reads, plans and generates, or reports every mistake.
    pub fn render(&self) -> Result<GeneratedModule, BuildError> {
        let config = ModelConfig::from_file(&self.path).map_err(BuildError::Config)?;
        let name = self.struct_name();
        let ident: proc_macro2::Ident =
            syn::parse_str(&name).map_err(|_| BuildError::Name(name.clone()))?;
        let unit_kinds = match &self.unit_kinds {
            Some(text) => Some(parse_unit_kinds(text).map_err(BuildError::Option)?),
            None => None,
        };
        let resolved = Resolved {
            config,
            ep: self.ep,
            pp: self.pp,
            first_stage_layers: self.first_stage_layers,
            last_stage_layers: self.last_stage_layers,
            unit_kinds,
            non_unit_bucket_cap: self.non_unit_bucket_cap,
        };
        let plan = Plan::new(&resolved.config, &plan_options(&resolved)).map_err(|mut d| {
            d.origin = format!("{} (pattern)", self.path.display());
            BuildError::Plan(d)
        })?;
        let module = module_name(&name);
        let description = format!(
            " Generated by `hybridgen::build` from `{}`.",
            self.path.display()
        );
        let spec = ModelSpec {
            module: syn::parse_str(&module).map_err(|_| BuildError::Name(name.clone()))?,
            name: ident,
            vis: syn::parse_quote!(pub),
            docs: vec![syn::parse_quote!(#[doc = #description])],
            forwarded: Vec::new(),
            krate: crate::facade_path(),
        };
        let tokens = generate(&spec, &resolved, &plan);
        let file: syn::File =
            syn::parse2(tokens).map_err(|e| BuildError::Generated(e.to_string()))?;
        let source = format!(
            "// @generated by hybridgen::build from {}. Do not edit: edit the model file.\n\n{}",
            self.path.display(),
            prettyplease::unparse(&file)
        );
        Ok(GeneratedModule {
            module,
            name,
            source,
        })
    }

    /// Renders and writes `<dir>/<module>.rs`, leaving an unchanged file
    /// untouched so cargo does not rebuild for nothing. Returns the path.
    pub fn write_to(&self, dir: &Path) -> Result<PathBuf, BuildError> {
        let generated = self.render()?;
        let path = dir.join(format!("{}.rs", generated.module));
        let io = |source| BuildError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        if std::fs::read_to_string(&path).ok().as_deref() != Some(generated.source.as_str()) {
            std::fs::write(&path, &generated.source).map_err(io)?;
        }
        Ok(path)
    }
}

/// `group,E` -> kinds, or H027 naming the entry that is not a kind.
fn parse_unit_kinds(text: &str) -> Result<Vec<UnitKind>, Diagnostic> {
    text.split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| {
            UnitKind::parse(part).ok_or_else(|| {
                Diagnostic::new(Code::H027, format!("`{part}` is not a unit kind")).help(
                    "unit kinds are the layer symbols M * + D G - E, `group` and `mtp`, separated by commas",
                )
            })
        })
        .collect()
}

/// `nemotron-nano-9b-v2` -> `NemotronNano9bV2`.
fn upper_camel(stem: &str) -> String {
    let mut out = String::new();
    for word in stem.split(|c: char| !c.is_alphanumeric()) {
        let mut chars = word.chars();
        if let Some(first) = chars.next() {
            out.extend(first.to_uppercase());
            out.push_str(chars.as_str());
        }
    }
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert_str(0, "Model");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_names_come_from_file_stems() {
        assert_eq!(upper_camel("nemotron-nano-9b-v2"), "NemotronNano9bV2");
        assert_eq!(upper_camel("tiny"), "Tiny");
        assert_eq!(upper_camel("3-layers"), "Model3Layers");
        assert_eq!(ModelFile::new("a/b/my_model.toml").struct_name(), "MyModel");
    }

    #[test]
    fn bad_unit_kinds_are_h027() {
        assert_eq!(parse_unit_kinds("group, E").unwrap().len(), 2);
        assert_eq!(parse_unit_kinds("group,Q").unwrap_err().code, Code::H027);
    }

    #[test]
    fn renders_a_preset_file_and_reports_a_broken_one() {
        let dir = std::env::temp_dir().join(format!("hybridgen-build-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("tiny.toml");
        std::fs::write(&good, ModelConfig::preset_source("tiny").unwrap()).unwrap();
        let generated = ModelFile::new(&good).ep(2).render().unwrap();
        assert_eq!(generated.module, "tiny");
        assert!(generated.source.contains("pub mod tiny {"));
        assert!(generated.source.contains("pub const EP: usize = 2;"));
        let written = ModelFile::new(&good).write_to(&dir.join("out")).unwrap();
        assert!(written.ends_with("out/tiny.rs"));

        let bad = dir.join("bad.toml");
        std::fs::write(
            &bad,
            ModelConfig::preset_source("tiny")
                .unwrap()
                .replace("M[*E]M-[*E]", "M[[*E]]"),
        )
        .unwrap();
        let error = ModelFile::new(&bad).render().unwrap_err().to_string();
        assert!(error.contains("error[H005]"), "{error}");
        assert!(error.contains("bad.toml (pattern):1:3"), "{error}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
