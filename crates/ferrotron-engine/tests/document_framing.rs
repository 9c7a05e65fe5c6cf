//! Documents are framed with each tokenizer's own BOS and EOS exactly as transformers' tokenizer
//! frames them (`tokenizer(text)["input_ids"]`, then the EOS), for Llama-3-, Mistral- and
//! Qwen-style tokenizers (`tests/fixtures/tokenizers/`, made by `make_tokenizer_references.py`);
//! and JSON Lines data is read one document per line.

mod common;

use common::fixture;
use ferrotron_engine::data;

#[test]
fn documents_are_framed_as_transformers_frames_them() {
    for style in ["llama3", "mistral", "qwen2"] {
        let dir = fixture("tokenizers").join(style);
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let docs: Vec<String> = expected["documents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap().to_string())
            .collect();
        let want: Vec<u32> = expected["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let path = dir.join("tokenizer.json");
        let tok = data::load_tokenizer(&path).unwrap();
        let framing = data::DocumentFraming::for_tokenizer(&tok, &path).unwrap();
        let got = data::encode_documents(&tok, &framing, &docs).unwrap();
        assert_eq!(got, want, "{style}: {framing:?}");
    }
}

#[test]
fn json_lines_hold_one_document_per_line() {
    let dir = std::env::temp_dir().join(format!("ferrotron-jsonl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("docs.jsonl");
    std::fs::write(
        &good,
        "{\"text\": \"first document\", \"id\": 1}\n\n{\"text\": \"second\\nwith a newline\"}\n",
    )
    .unwrap();
    let docs = data::read_corpus(good.to_str().unwrap()).unwrap();
    assert_eq!(docs, ["first document", "second\nwith a newline"]);
    for (body, said) in [
        ("{\"content\": \"x\"}\n", "line 1: no `text` field"),
        (
            "{\"text\": \"ok\"}\n{\"text\": 3}\n",
            "line 2: `text` must be a string",
        ),
        (
            "{\"text\": \"ok\"}\nnot json\n",
            "line 2: not a JSON object",
        ),
    ] {
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, body).unwrap();
        let e = data::read_corpus(bad.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains(said) && e.contains("bad.jsonl"), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
