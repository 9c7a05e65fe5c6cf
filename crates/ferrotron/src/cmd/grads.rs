use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotron_engine::hf::{self, StorageDtype};
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::runtime::layout_step;
use ferrotron_engine::transformer::TokenBatch;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct GradsArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// safetensors file with an int64 `input_ids` tensor of shape [batch, seq].
    #[arg(long)]
    tokens: PathBuf,
    /// Layout spec (see the README).
    #[arg(long, default_value = "")]
    layout: String,
    /// Output safetensors: `loss` and `grad.<name>` for every parameter, full Hugging Face shapes.
    #[arg(long)]
    out: PathBuf,
    /// Kernel threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where the devices run: `threads` (one process) or `mpi` (one rank per device, under mpirun;
    /// needs a build with `--features mpi`).
    #[arg(long, default_value = "threads")]
    backend: String,
}

/// Reads `input_ids` ([batch, seq], int64 or int32) from a safetensors file.
pub fn read_input_ids(path: &Path) -> Result<TokenBatch> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display()))?;
    let view = st
        .tensor("input_ids")
        .map_err(|_| anyhow::anyhow!("{}: tensor `input_ids` is missing", path.display()))?;
    let shape = view.shape().to_vec();
    if shape.len() != 2 {
        bail!(
            "{}: tensor `input_ids` has shape {shape:?}, expected [batch, seq]",
            path.display()
        );
    }
    let ids: Vec<i64> = match view.dtype() {
        safetensors::Dtype::I64 => view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        safetensors::Dtype::I32 => view
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
            .collect(),
        d => bail!(
            "{}: tensor `input_ids` has dtype {d:?}, expected int64",
            path.display()
        ),
    };
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i > u32::MAX as i64) {
        bail!("{}: `input_ids` holds the invalid id {bad}", path.display());
    }
    Ok(TokenBatch {
        ids: ids.into_iter().map(|i| i as u32).collect(),
        batch: shape[0],
        seq: shape[1],
    })
}

pub fn run(a: GradsArgs) -> Result<()> {
    let layout = super::concrete_layout(&a.layout)?;
    let (cfg, params) = hf::load_model(&a.model)?;
    let batch = read_input_ids(&a.tokens)?;
    if let Some(bad) = batch.ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        bail!(
            "{}: token id {bad} is outside the model's vocabulary of {}",
            a.tokens.display(),
            cfg.vocab_size
        );
    }
    if batch.seq > cfg.max_position_embeddings {
        bail!(
            "{}: sequence length {} exceeds the model's max_position_embeddings {}",
            a.tokens.display(),
            batch.seq,
            cfg.max_position_embeddings
        );
    }
    let be = if a.threads == 0 {
        CpuBackend::default()
    } else {
        CpuBackend { threads: a.threads }
    };
    let (mean_loss, grads) = match super::backend::Backend::parse(&a.backend)? {
        super::backend::Backend::Threads => {
            let (loss, grads, _) = layout_step(&cfg, &params, &batch, &layout, &be)?;
            (loss, grads)
        }
        // Every rank computes its device; rank 0 writes the gathered result.
        super::backend::Backend::Mpi => {
            match super::backend::mpi_layout_step(&cfg, &params, &batch, &layout)? {
                Some((loss, grads, _)) => (loss, grads),
                None => return Ok(()),
            }
        }
    };
    let loss = [mean_loss as f32];
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> = vec![("loss".into(), vec![], &loss[..])];
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        tensors.push((format!("grad.{}", spec.name), spec.shape.clone(), g));
    }
    hf::write_tensors(&a.out, &tensors, StorageDtype::F32)?;
    println!(
        "loss {:.8}; {} gradients written to {}",
        mean_loss,
        grads.specs.len(),
        a.out.display()
    );
    Ok(())
}
