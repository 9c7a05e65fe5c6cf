//! Activations kept for backward in 16 bits (the first piece of mixed precision): the stash halves,
//! and the gradients stay within what rounding the kept tensors to the format allows.

mod common;

use common::*;
use ferrotron_core::precision::Half;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::transformer::Transformer;

#[test]
fn a_16_bit_stash_halves_and_keeps_the_gradients_close() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batch = random_batch(cfg.vocab_size, 2, 64, 4);
        let be = CpuBackend::single_threaded();
        let run = |storage: Option<Half>| {
            let tf = Transformer::new(&cfg, &params).with_activation_storage(storage);
            let state = tf.forward(&be, &params, &batch);
            let bytes = state.stashed_bytes();
            let mut grads = params.zeros_like();
            let n = batch.predicted_tokens() as f32;
            let loss = tf.backward(&be, &params, &mut grads, state, &batch.targets(), 1.0 / n);
            (loss, grads, bytes)
        };
        let (loss, want, full) = run(None);
        // bf16 keeps 8 significant bits (u = 2⁻⁹), f16 11 (u = 2⁻¹²): each kept value moves by at
        // most u relative, and a gradient, a smooth function of them, by a small multiple.
        for (storage, u) in [(Half::Bf16, 2f64.powi(-9)), (Half::F16, 2f64.powi(-12))] {
            let (l, got, half) = run(Some(storage));
            assert_eq!(
                l, loss,
                "{model}: the forward pass (and so the loss) is the same f32 arithmetic"
            );
            let ratio = half as f64 / full as f64;
            // The logits (for the loss) and the norms' statistics stay f32.
            assert!(
                (0.5..0.65).contains(&ratio),
                "{model} {storage:?}: stash ratio {ratio}"
            );
            for (spec, g) in got.specs.iter().zip(&got.tensors) {
                let e = rel_err(g, want.get(&spec.name).unwrap());
                assert!(
                    e <= 16.0 * u,
                    "{model} {storage:?}: {} rel err {e:e}",
                    spec.name
                );
            }
        }
    }
}
