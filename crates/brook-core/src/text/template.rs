//! The chat template: loads the Jinja source a checkpoint ships and renders a conversation into
//! the prompt string, byte-identical to transformers' `apply_chat_template(..., tokenize=False)`.
//!
//! Mirrors transformers' `_compile_jinja_template`: `trim_blocks` and `lstrip_blocks` on, the
//! trailing newline dropped (Jinja's default), no autoescape, Python string methods
//! (minijinja-contrib's pycompat), a `tojson` that is `json.dumps(..., ensure_ascii=False)`,
//! `raise_exception` and `strftime_now`. Template selection mirrors `get_chat_template`:
//! `chat_template.jinja` wins over `tokenizer_config.json`, and the list form picks
//! `"tool_use"` when tools are given and it exists, else `"default"`. It must not tokenize.

use std::path::Path;

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Map;

use super::message::Message;
use super::pyjson::{self, DumpOptions};
use super::{Result, TextError, strftime};

const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

/// The budget of one render. A template comes with the model files, which may come from
/// anyone, so a render is bounded: `FUEL` minijinja instructions (about 1.5 s at worst on a
/// 2-core dev machine; the Qwen3.6 template spends about 180 per message, 4000 messages render
/// in 21 ms, so a context full of one-token messages stays well within it), at most `MAX_OUTPUT` bytes of prompt
/// (the longest context's text is a few MB), values printed or passed to `tojson` at most
/// `MAX_DEPTH` containers deep (which also stops a namespace that holds itself there), and a
/// `tojson` indent of at most `MAX_INDENT`. minijinja itself limits ranges, repeated
/// sequences and recursion (500 levels).
pub const FUEL: u64 = 50_000_000;
pub const MAX_OUTPUT: usize = 32 << 20;
pub const MAX_DEPTH: usize = 64;
pub const MAX_INDENT: usize = 32;

/// A compiled chat template plus the special-token strings templates may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Names of the compiled templates (`"default"`, `"tool_use"`, ...).
    names: Vec<String>,
    /// `bos_token` from tokenizer_config.json (Qwen: none).
    pub bos_token: Option<String>,
    /// `eos_token` from tokenizer_config.json (Qwen: `<|im_end|>`).
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// The error a `raise_exception(...)` call carries through minijinja, so it can be told apart
/// from engine errors after rendering.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles a single template source (the content of a `chat_template.jinja`).
    pub fn new(source: impl Into<String>) -> Result<Self> {
        Self::from_named(vec![(DEFAULT.to_string(), source.into())])
    }

    /// Compiles named templates (tokenizer_config.json's list form).
    pub fn from_named(templates: Vec<(String, String)>) -> Result<Self> {
        let mut env = base_environment();
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            env.add_template_owned(name.clone(), source).map_err(|e| {
                TextError::TemplateSyntax {
                    message: format!("template {name:?}: {e:#}"),
                }
            })?;
            names.push(name);
        }
        Ok(Self {
            env,
            names,
            bos_token: None,
            eos_token: None,
        })
    }

    /// Loads the template a checkpoint directory ships: `chat_template.jinja` if present, else
    /// `chat_template.json`, else `tokenizer_config.json`'s `chat_template`. Special-token
    /// strings come from tokenizer_config.json either way. `Ok(None)` when there is none.
    pub fn from_dir(model_dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = model_dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        let jinja = dir.join("chat_template.jinja");
        let json = dir.join("chat_template.json");
        let mut template = if jinja.is_file() {
            let source = super::read_text(&jinja, crate::util::MAX_CONFIG)?;
            Self::new(source)?
        } else if json.is_file() {
            match Self::from_config_value(&read_json(&json)?, &json)? {
                Some(t) => t,
                None => return Ok(None),
            }
        } else {
            match &config {
                Some(c) => match Self::from_config_value(c, &config_path)? {
                    Some(t) => t,
                    None => return Ok(None),
                },
                None => return Ok(None),
            }
        };
        if let Some(c) = &config {
            template.bos_token = token_string(c.get("bos_token"));
            template.eos_token = token_string(c.get("eos_token"));
        }
        Ok(Some(template))
    }

    /// Reads `chat_template` (string or list of `{name, template}`) and the bos/eos strings out
    /// of a parsed tokenizer_config.json. `path` only names the file in errors.
    pub fn from_tokenizer_config(config: &serde_json::Value, path: &Path) -> Result<Option<Self>> {
        let mut t = match Self::from_config_value(config, path)? {
            Some(t) => t,
            None => return Ok(None),
        };
        t.bos_token = token_string(config.get("bos_token"));
        t.eos_token = token_string(config.get("eos_token"));
        Ok(Some(t))
    }

    fn from_config_value(config: &serde_json::Value, path: &Path) -> Result<Option<Self>> {
        let bad = |problem: &str| TextError::Config {
            path: path.to_path_buf(),
            field: "chat_template".into(),
            problem: problem.into(),
        };
        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Self::new(s.clone()).map(Some),
            Some(serde_json::Value::Array(list)) => {
                let mut named = Vec::with_capacity(list.len());
                for entry in list {
                    let name = entry.get("name").and_then(|v| v.as_str());
                    let source = entry.get("template").and_then(|v| v.as_str());
                    match (name, source) {
                        (Some(n), Some(s)) => named.push((n.to_string(), s.to_string())),
                        _ => return Err(bad("has a list entry without `name` and `template`")),
                    }
                }
                Self::from_named(named).map(Some)
            }
            Some(_) => Err(bad("must be a string or a list of {name, template}")),
        }
    }

    /// Which named template a render uses: `"tool_use"` when tools are given and it exists,
    /// else `"default"`, else the only one.
    fn pick(&self, with_tools: bool) -> Result<&str> {
        let has = |n: &str| self.names.iter().any(|x| x == n);
        if with_tools && has(TOOL_USE) {
            return Ok(TOOL_USE);
        }
        if has(DEFAULT) {
            return Ok(DEFAULT);
        }
        match self.names.as_slice() {
            [only] => Ok(only),
            _ => Err(TextError::InvalidInput(format!(
                "the tokenizer config has templates {:?} but none named \"default\"",
                self.names
            ))),
        }
    }

    /// Renders `messages` into a prompt. `tools` are OpenAI tool schemas; `extra` carries
    /// template switches such as `enable_thinking` or `preserve_thinking` (they may also
    /// override `bos_token`/`eos_token`, as transformers' kwargs do).
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: &Map<String, serde_json::Value>,
    ) -> Result<String> {
        for key in ["messages", "tools", "documents", "add_generation_prompt"] {
            if extra.contains_key(key) {
                return Err(TextError::InvalidInput(format!(
                    "template argument `{key}` is set by render itself; pass it as a parameter"
                )));
            }
        }
        let mut ctx = Map::new();
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), b.clone().into());
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), e.clone().into());
        }
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        let msgs: Vec<serde_json::Value> =
            messages.iter().map(Message::to_template_value).collect();
        ctx.insert("messages".into(), msgs.into());
        ctx.insert(
            "tools".into(),
            tools.map_or(serde_json::Value::Null, |t| t.to_vec().into()),
        );
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let ctx = to_jinja(serde_json::Value::Object(ctx))?;

        let tmpl = self
            .env
            .get_template(self.pick(tools.is_some())?)
            .map_err(|e| TextError::TemplateSyntax {
                message: format!("{e:#}"),
            })?;
        super::isolate::render(|| {
            let mut out = Capped(Vec::new());
            tmpl.render_captured_to(ctx, &mut out)
                .map_err(render_error)?;
            String::from_utf8(out.0).map_err(|_| TextError::TemplateRender {
                message: "the template wrote bytes that are not UTF-8".into(),
            })
        })
    }
}

/// The render's output, refusing to grow past [`MAX_OUTPUT`].
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_OUTPUT {
            return Err(std::io::Error::other(format!(
                "the template's output passed {} MiB; a chat prompt is never that long",
                MAX_OUTPUT >> 20
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Fails when `v` nests containers deeper than [`MAX_DEPTH`] (what printing a namespace that
/// holds itself would recurse into until the stack overflows).
fn check_depth(v: &Value, depth: usize) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    if !matches!(v.kind(), ValueKind::Map | ValueKind::Seq) {
        return Ok(());
    }
    if depth >= MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("a value nests more than {MAX_DEPTH} levels deep (does it contain itself?)"),
        ));
    }
    let items: Vec<Value> = v.try_iter()?.collect();
    for item in &items {
        check_depth(item, depth + 1)?;
        if v.kind() == ValueKind::Map {
            check_depth(&v.get_item(item)?, depth + 1)?;
        }
    }
    Ok(())
}

fn to_jinja(v: serde_json::Value) -> Result<Value> {
    use serde::Deserialize;
    Value::deserialize(v).map_err(|e| TextError::InvalidInput(e.to_string()))
}

fn render_error(e: Error) -> TextError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return TextError::TemplateRaised {
                message: raised.0.clone(),
            };
        }
        cur = err.source();
    }
    TextError::TemplateRender {
        message: format!("{e:#}"),
    }
}

/// tokenizer_config.json stores special tokens as a string or as an AddedToken object.
fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// tokenizer_config.json or chat_template.json (a tokenizer config carries its added tokens,
/// so it gets the tokenizer's cap).
fn read_json(path: &Path) -> Result<serde_json::Value> {
    super::read_json(path, crate::util::MAX_TOKENIZER)
}

/// The environment transformers builds, as far as templates can tell.
fn base_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .unwrap_or_default(),
    );
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_fuel(Some(FUEL));
    env.set_formatter(|out, state, value| {
        check_depth(value, 0)?;
        minijinja::escape_formatter(out, state, value)
    });
    env.add_filter("string", |value: Value| -> Result<Value, Error> {
        check_depth(&value, 0)?;
        Ok(Value::from(value.to_string()))
    });
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: String| {
        strftime::strftime_now(&format)
    });
    env
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, "raise_exception").with_source(Raised(message)))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(MAX_INDENT + 1))),
            None => Some(v.as_str().unwrap_or_default().to_string()),
        },
    };
    if indent.as_ref().is_some_and(|s| s.len() > MAX_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson indent is limited to {MAX_INDENT} characters"),
        ));
    }
    check_depth(&value, 0)?;
    let mut opts = DumpOptions::default().with_indent(indent);
    if let Some(ensure_ascii) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        opts.ensure_ascii = ensure_ascii;
    }
    if let Some(sort_keys) = kwargs.get::<Option<bool>>("sort_keys")? {
        opts.sort_keys = sort_keys;
    }
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")?
        && !seps.is_none()
    {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] => {
                opts.item_sep = item.as_str().unwrap_or_default().to_string();
                opts.key_sep = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair (item_separator, key_separator)",
                ));
            }
        }
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(pyjson::dumps(&value, &opts)?))
}
