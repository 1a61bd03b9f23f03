//! An OpenAI-compatible HTTP API in front of the binary generate op.
//!
//! `POST /v1/completions`, `POST /v1/chat/completions` (chat template applied), `GET
//! /v1/models`; streaming with server-sent events (`"stream": true`, `stream_options.
//! include_usage`) and non-streaming; `max_tokens`, `stop`, `ignore_eos`; usage counts;
//! OpenAI-style JSON errors (400 for bad JSON or fields, 404 for another model's name, 503
//! when the server is full). Tokenizing, chat templating and detokenizing run here, on the
//! API's own threads, never on transport or executor threads; each request then travels as
//! one binary generate request (see [`backend`]). Decoding is greedy: sampling parameters
//! (`temperature`, `top_p`, `seed`, ...) are accepted and ignored, as documented in
//! `docs/api.md`.

pub mod backend;
pub mod detok;
mod openai;

use std::net::SocketAddr;
use std::sync::Arc;

pub use openai::ChatMessage;

/// Text to tokens and back, for one model.
pub trait TextCodec: Send + Sync + 'static {
    /// Tokenize a completion prompt (with the special tokens the tokenizer adds, e.g. BOS).
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// Tokenize a rendered chat prompt (its special tokens are already in the text).
    fn encode_chat(&self, text: &str) -> Result<Vec<u32>, String>;
    /// Detokenize, skipping special tokens.
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
    /// Render a conversation with the model's chat template, ending with the assistant's
    /// turn opened. `Err` when the model has no chat template or rendering fails.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String>;
}

/// Settings of the API server.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The model name reported by `/v1/models` and accepted in requests.
    pub model: String,
    /// The server's binary listener that generate requests are sent to.
    pub backend: SocketAddr,
    /// Longest prompt in tokens (the binary listener's `--max-words`).
    pub max_prompt_tokens: usize,
    /// `max_tokens` when a completion request gives none (OpenAI's default is 16).
    pub default_completion_tokens: u32,
    /// `max_tokens` when a chat request gives none.
    pub default_chat_tokens: u32,
}

/// Largest `max_tokens` (the generate op's param limit).
pub const MAX_TOKENS: u32 = bgs_protocol::MAX_NEW_TOKENS;

/// Serve the API on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: ApiConfig,
    codec: Arc<dyn TextCodec>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = openai::router(Arc::new(openai::State::new(cfg, codec)));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Run the API on its own small tokio runtime in a background thread (the rest of the
/// server is not async). Returns once the listener is bound, with its address.
pub fn spawn(
    listen: SocketAddr,
    cfg: ApiConfig,
    codec: Arc<dyn TextCodec>,
    threads: usize,
) -> std::io::Result<ApiHandle> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name("bgs-api")
        .enable_all()
        .build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind(listen))?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("bgs-api-main".into())
        .spawn(move || {
            let r = rt.block_on(serve(listener, cfg, codec, async move {
                let _ = stop_rx.await;
            }));
            if let Err(e) = r {
                tracing::error!("API server failed: {e}");
            }
            // In-flight streams are cut when the runtime goes away.
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
        })?;
    Ok(ApiHandle {
        addr,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

/// A running API server.
#[derive(Debug)]
pub struct ApiHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ApiHandle {
    /// The address the API listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting, let open responses end, and join the thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ApiHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}
