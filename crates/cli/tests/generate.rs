//! Generation end to end: `bgs serve --model` on every transport with `bgs load --op
//! generate` (binary and HTTP, exact replay), the OpenAI-compatible API with curl and the
//! official `openai` Python package, and `bgs generate` with the real SmolLM2 weights.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{Server, load_config, transports};

/// A tiny synthetic Llama checkpoint, written once per test binary.
fn tiny_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("bgs-gen-test-{}", std::process::id()));
        let st = Command::new(env!("CARGO_BIN_EXE_bgs"))
            .args([
                "model",
                "synth",
                "--arch",
                "tiny-llama",
                "--seed",
                "5",
                "--out",
            ])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(st.success(), "bgs model synth failed");
        dir
    })
}

/// A path from an environment variable a test needs; `None` (skip) outside CI, a failure in
/// CI, where `scripts/test.sh` provides it.
fn required_env(var: &str, how: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var_os("CI").is_some() => {
            panic!("{var} is not set; in CI it must be ({how})")
        }
        _ => {
            eprintln!("skipping: {var} is not set ({how})");
            None
        }
    }
}

/// 200 generate requests per framing on each transport, every stream replayed exactly
/// against its golden stream, zero failures.
#[test]
fn generate_over_every_transport_binary_and_http() {
    let model = tiny_model().to_str().unwrap().to_string();
    for t in transports() {
        let mut args: Vec<&str> = t.clone();
        args.extend(["--model", &model, "--api-listen", "off", "--slots", "8"]);
        let mut server = Server::start(&args);
        for http in [false, true] {
            let mut cfg = load_config(server.addr, bgs_protocol::Op::Generate);
            cfg.rate = 400.0;
            cfg.requests = Some(200);
            cfg.connections = 8;
            cfg.http = http;
            cfg.distinct_payloads = 16;
            cfg.generate = bgs_load::GenerateConfig {
                prompt_tokens: 12,
                max_tokens: 24,
                ignore_eos: !http,
                token_range: 256,
            };
            let report = bgs_load::run(&cfg).expect("load run");
            assert_eq!(report.failures, 0, "{t:?} http={http}: {report}");
            assert_eq!(report.counts.ok, 200, "{t:?} http={http}: {report}");
            let g = report.generate.as_ref().expect("generate section");
            assert!(g.tokens > 0, "{report}");
            if !http {
                // Ignore-EOS runs every stream to its limit.
                assert_eq!(g.tokens, 200 * 24, "{report}");
            }
        }
        let (ok, err) = server.stop();
        assert!(ok, "{t:?}: server did not stop cleanly: {err}");
    }
}

/// The API with curl: a completion, a streamed chat completion, and an OpenAI-style error.
#[test]
fn api_with_curl() {
    let model = tiny_model().to_str().unwrap().to_string();
    let (_server, api) =
        Server::start_with_api(&["--model", &model, "--api-listen", "127.0.0.1:0"]);
    let curl = |path: &str, body: Option<&str>| -> (String, String) {
        let mut c = Command::new("curl");
        c.args(["-sS", "-N", "-m", "20", "-w", "\n%{http_code}"]);
        if let Some(b) = body {
            c.args(["-H", "Content-Type: application/json", "-d", b]);
        }
        let out = c.arg(format!("http://{api}{path}")).output().expect("curl");
        let text = String::from_utf8(out.stdout).unwrap();
        let (body, code) = text.rsplit_once('\n').unwrap();
        (code.to_string(), body.to_string())
    };
    let (code, body) = curl("/v1/models", None);
    assert_eq!(code, "200", "{body}");
    assert!(body.contains("\"object\":\"list\""), "{body}");
    let (code, body) = curl(
        "/v1/completions",
        Some(r#"{"prompt":"Hello","max_tokens":5,"ignore_eos":true}"#),
    );
    assert_eq!(code, "200", "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{body}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (code, body) = curl(
        "/v1/chat/completions",
        Some(
            r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,
                "ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
    );
    assert_eq!(code, "200", "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(body.contains("\"completion_tokens\":4"), "{body}");
    let (code, body) = curl("/v1/completions", Some(r#"{"prompt":"x","max_tokens":0}"#));
    assert_eq!(code, "400", "{body}");
    assert!(body.contains("invalid_request_error"), "{body}");
}

/// The official `openai` Python package, streaming and not (`scripts/test.sh` installs it
/// and sets BGS_PYTHONPATH).
#[test]
fn api_with_the_openai_package() {
    let Some(pypath) = required_env("BGS_PYTHONPATH", "scripts/test.sh installs `openai`") else {
        return;
    };
    let model = tiny_model().to_str().unwrap().to_string();
    let (_server, api) =
        Server::start_with_api(&["--model", &model, "--api-listen", "127.0.0.1:0"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{api}/v1"))
        .env("PYTHONPATH", pypath)
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("openai client: all checks passed"),
        "{stdout}"
    );
}

/// The real SmolLM2-135M-Instruct (Q4_1 GGUF) completes a well-known fact.
#[test]
fn smollm2_knows_the_capital_of_france() {
    let Some(gguf) = required_env(
        "BGS_SMOLLM2_GGUF",
        "eval \"$(bash scripts/fetch-models.sh)\" provides it",
    ) else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args(["generate", "--model", &gguf, "--max-tokens", "8"])
        .args(["--prompt", "The capital of France is"])
        .env("BGS_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("Paris"), "completion was {text:?}");
}

/// A server without a model answers generate with status 18 (unknown op), and model flags
/// without `--model` are refused.
#[test]
fn without_a_model_generate_is_unknown_and_model_flags_are_refused() {
    let server = Server::start(&[]);
    let mut c = bgs_load::client::FrameClient::connect(server.addr).unwrap();
    let h = bgs_protocol::RequestHeader::new(bgs_protocol::Op::Generate, 9, 2, 4);
    let reply = c.request(&h, &[1, 2]).unwrap();
    assert_eq!(reply.header.status, bgs_protocol::Status::UnknownOp as u16);
    let out = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args(["serve", "--kv-blocks", "10"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without --model"), "{err}");
}

/// `--executor gpu` with a model builds the GPU forward pass; without a GPU (CI) it fails
/// before the port accepts, with one line naming the GPU problem, for `bgs serve` and
/// `bgs generate` alike.
#[test]
fn gpu_forward_pass_without_a_gpu_fails_with_a_message() {
    let model = tiny_model().to_str().unwrap();
    for args in [
        vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model",
            model,
            "--executor",
            "gpu",
            "--api-listen",
            "off",
        ],
        vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "hello",
            "--executor",
            "gpu",
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_bgs"))
            .args(&args)
            .env("CUDA_VISIBLE_DEVICES", "")
            .env("BGS_LOG", "warn")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            // A machine with a GPU: `bgs generate` ran on it (a server would not exit).
            assert_eq!(args[0], "generate", "{err}");
            continue;
        }
        assert!(err.contains("building the GPU model"), "{args:?}: {err}");
    }
}
