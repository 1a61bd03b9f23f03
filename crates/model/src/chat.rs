//! Chat templates: Hugging Face Jinja templates rendered with `minijinja`, configured as
//! `transformers` does (`trim_blocks`, `lstrip_blocks`, Python string methods, `tojson`,
//! `raise_exception`, `strftime_now`).

use serde::Serialize;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template rendering failed (or did not compile).
#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct ChatTemplateError(pub String);

/// A compiled chat template.
pub struct ChatTemplate {
    source: String,
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl Clone for ChatTemplate {
    fn clone(&self) -> ChatTemplate {
        ChatTemplate::new(&self.source, &self.bos_token, &self.eos_token)
            .expect("a template that compiled once compiles again")
    }
}

/// The date `strftime_now` reports: templates only use it to print "today's date" into a
/// system prompt, and a fixed value keeps rendering deterministic.
const FIXED_DATE: &str = "26 Jul 2024";

impl ChatTemplate {
    /// Compile `source`; `bos_token`/`eos_token` are the strings templates see under those
    /// names (empty when the model has none).
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |format: String| -> String {
            // Only the common date formats are translated; anything else gets the fixed date.
            match format.as_str() {
                "%Y-%m-%d" => "2024-07-26".to_string(),
                _ => FIXED_DATE.to_string(),
            }
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatTemplateError(e.to_string()))?;
        Ok(ChatTemplate {
            source: source.to_string(),
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render a conversation; `add_generation_prompt` appends the assistant turn's opening.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ChatTemplateError(e.to_string()))?;
        t.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| ChatTemplateError(format!("{e:#}")))
    }
}

/// The chat template of a `tokenizer_config.json` document: `chat_template` as a string, or
/// the list form (`[{"name": "default", "template": ...}, ...]`), which yields the "default"
/// entry (or the first one).
pub fn template_from_tokenizer_config(cfg: &serde_json::Value) -> Option<String> {
    match cfg.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|e| e.get("name").and_then(|v| v.as_str()) == Some(n))
            };
            named("default")
                .or_else(|| list.first())
                .and_then(|e| e.get("template")?.as_str().map(str::to_string))
        }
        _ => None,
    }
}

/// A minimal ChatML template (`<|im_start|>role\ncontent<|im_end|>\n`).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, "", "<|im_end|>").unwrap();
        let s = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn hf_features() {
        let src = "{%- for m in messages %}{%- if m.role == 'bad' %}{{ raise_exception('bad role') }}{%- endif %}\n  {%- if loop.index0 > 5 %}{% break %}{% endif %}[{{ m.content.strip() | upper }}]{{ m | tojson }}{% endfor %}{{ bos_token }}{{ strftime_now('%d %b %Y') }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let s = t
            .render(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(
            s,
            "[HI]{\"role\": \"user\", \"content\": \"  hi  \"}<s>26 Jul 2024"
        );
        let e = t
            .render(&[ChatMessage::new("bad", "x")], false)
            .unwrap_err();
        assert!(e.to_string().contains("bad role"), "{e}");
    }

    #[test]
    fn list_form() {
        let cfg = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(template_from_tokenizer_config(&cfg).as_deref(), Some("D"));
        let cfg = serde_json::json!({"chat_template": "S"});
        assert_eq!(template_from_tokenizer_config(&cfg).as_deref(), Some("S"));
        assert_eq!(template_from_tokenizer_config(&serde_json::json!({})), None);
    }
}
