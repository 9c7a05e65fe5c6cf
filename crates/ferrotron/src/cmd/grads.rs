use anyhow::Result;
use clap::Args;
use ferrotron_engine::comm::CommBackend;
use ferrotron_engine::hf::{self, StorageDtype};
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::runtime::layout_step_of;
use std::path::PathBuf;

#[derive(Args)]
pub struct GradsArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// safetensors file with an int64 `input_ids` tensor of shape [batch, seq].
    #[arg(long)]
    tokens: PathBuf,
    /// Layout spec (see docs/train.md).
    #[arg(long, default_value = "")]
    layout: String,
    /// Output safetensors: `loss` and `grad.<name>` for every parameter, full Hugging Face shapes
    /// (with `--adapter`, for every adapter tensor).
    #[arg(long)]
    out: PathBuf,
    /// Kernel threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where the devices run: `threads` (one process) or `mpi` (one rank per device, under mpirun;
    /// needs a build with `--features mpi`).
    #[arg(long, default_value_t = CommBackend::Threads)]
    backend: CommBackend,
    /// A PEFT LoRA adapter directory on the model: the base is frozen, and the output holds the
    /// gradient of every adapter tensor, named as in its `adapter_model.safetensors`.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// With --adapter: QLoRA, the base's projections quantized to `nf4` (as bitsandbytes' NF4
    /// with double quantization) and dequantized a panel at a time into the GEMM's operand.
    #[arg(long)]
    quantize_base: Option<ferrotron_core::precision::BaseQuantization>,
}

pub fn run(a: GradsArgs) -> Result<()> {
    let layout = super::concrete_layout(&a.layout)?;
    let model = super::backend::StepModel::load(&a.model, a.adapter.as_deref(), a.quantize_base)?;
    let cfg = &model.cfg;
    let batch = ferrotron_engine::data::read_token_file(&a.tokens)?;
    batch
        .check(cfg)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.tokens.display()))?;
    let be = if a.threads == 0 {
        CpuBackend::default()
    } else {
        CpuBackend::with_threads(a.threads)
    };
    let (mean_loss, grads) = match a.backend {
        CommBackend::Threads => {
            let (loss, grads, _) = layout_step_of(cfg, model.trained(), &batch, &layout, &be)?;
            (loss, grads)
        }
        // Every rank computes its device; rank 0 writes the gathered result.
        CommBackend::Mpi => {
            match super::backend::mpi_layout_step(cfg, model.trained(), &batch, &layout)? {
                Some((loss, grads, _)) => (loss, grads),
                None => return Ok(()),
            }
        }
    };
    let loss = [mean_loss as f32];
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> = vec![("loss".into(), vec![], &loss[..])];
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        tensors.push((model.grad_name(&spec.name), spec.shape.clone(), g));
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
