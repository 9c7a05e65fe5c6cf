use super::concrete_layout;
use anyhow::Result;
use clap::Subcommand;
use ferrotron_engine::checkpoint;
use ferrotron_engine::hf::StorageDtype;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum CheckpointCommand {
    /// Verify every file's checksum and print the layout, the step, the tensors and their sizes.
    Inspect {
        /// A step-NNNNNN directory, or a checkpoint directory with `latest`.
        dir: PathBuf,
    },
    /// Rewrite a checkpoint for another layout (parameters and Adam moments resharded).
    Reshard {
        /// The checkpoint to read: a step-NNNNNN directory, or a checkpoint directory with `latest`.
        dir: PathBuf,
        /// The target layout, e.g. `dp=2,tp=2,zero=3`.
        #[arg(long)]
        layout: String,
        /// The checkpoint directory to write it into (its `latest` will name it).
        #[arg(long)]
        out: PathBuf,
        /// Replace what the destination already holds (another run's checkpoints, another
        /// model's files); without it such a destination is refused.
        #[arg(long)]
        overwrite: bool,
    },
    /// Write a checkpoint's weights as a Hugging Face model directory (config.json +
    /// model.safetensors + tokenizer.json) that transformers loads; a LoRA checkpoint's adapters
    /// as a PEFT adapter directory (`--adapter`) or merged into their base (`--merge`).
    Export {
        /// The checkpoint to read: a step-NNNNNN directory, or a checkpoint directory with `latest`.
        dir: PathBuf,
        /// The Hugging Face model directory to write (config.json, model.safetensors and the
        /// run's tokenizer.json).
        #[arg(long)]
        hf: Option<PathBuf>,
        /// f32, bf16 or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// LoRA: write the adapters as a PEFT adapter directory (adapter_config.json +
        /// adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads.
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// LoRA: with `--hf`, write the base with the adapters merged in (W + (alpha/r)·B·A).
        #[arg(long)]
        merge: bool,
        /// LoRA with `--merge`: the base model directory (default: the one the adapters were
        /// trained on, as the checkpoint records it).
        #[arg(long)]
        base: Option<PathBuf>,
        /// Replace what the destination already holds (another run's checkpoints, another
        /// model's files); without it such a destination is refused.
        #[arg(long)]
        overwrite: bool,
    },
    /// Import a Hugging Face model directory as a step-0 checkpoint (fresh optimizer), to train
    /// from with `ferrotron train --resume`.
    Import {
        /// A Hugging Face model directory (config.json, model.safetensors or a sharded index).
        hf_dir: PathBuf,
        /// The checkpoint directory to write.
        #[arg(long)]
        out: PathBuf,
        /// The layout to shard it for (default: one device).
        #[arg(long, default_value = "")]
        layout: String,
        /// Replace what the destination already holds (another run's checkpoints, another
        /// model's files); without it such a destination is refused.
        #[arg(long)]
        overwrite: bool,
    },
}

pub fn run(cmd: CheckpointCommand) -> Result<()> {
    match cmd {
        CheckpointCommand::Inspect { dir } => print!("{}", checkpoint::inspect(&dir)?),
        CheckpointCommand::Reshard {
            dir,
            layout,
            out,
            overwrite,
        } => {
            let layout = concrete_layout(&layout)?;
            let written = checkpoint::reshard(&dir, &layout, &out, overwrite)?;
            println!("resharded to `{layout}`: {}", written.display());
        }
        CheckpointCommand::Export {
            dir,
            hf,
            dtype,
            adapter,
            merge,
            base,
            overwrite,
        } => {
            let dtype = StorageDtype::parse(&dtype)?;
            if base.is_some() && !merge {
                anyhow::bail!("--base names the base model of `--merge`");
            }
            if let Some(out) = &adapter {
                checkpoint::export_adapter(&dir, out, overwrite)?;
                println!("adapters exported to {} (PEFT)", out.display());
            }
            match (&hf, merge) {
                (Some(out), true) => {
                    checkpoint::export_merged(&dir, base.as_deref(), out, dtype, overwrite)?;
                    println!("merged model exported to {}", out.display());
                }
                (Some(out), false) => {
                    checkpoint::export_hf(&dir, out, dtype, overwrite)?;
                    println!("exported to {}", out.display());
                }
                (None, true) => anyhow::bail!("--merge writes a model: give `--hf DIR`"),
                (None, false) if adapter.is_none() => {
                    anyhow::bail!("give `--hf DIR` (a model) or `--adapter DIR` (LoRA adapters)")
                }
                (None, false) => {}
            }
        }
        CheckpointCommand::Import {
            hf_dir,
            out,
            layout,
            overwrite,
        } => {
            let layout = concrete_layout(&layout)?;
            let written = checkpoint::import_hf(&hf_dir, &layout, &out, overwrite)?;
            println!("imported as step 0 for `{layout}`: {}", written.display());
        }
    }
    Ok(())
}
