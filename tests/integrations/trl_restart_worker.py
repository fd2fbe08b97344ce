"""One rank of `LongStrawGRPOTrainer` under torchrun for tests/test_elastic.py: the script a
user would write (`init_distributed()` before the trainer's `GRPOConfig`, then
`train(resume_from_checkpoint=True)`), on `trl_worker`'s tiny float64 case with a
checkpoint after every step. `python trl_restart_worker.py OUT KILL_AT`: on the first
attempt rank 1 SIGKILLs itself at the end of optimizer step KILL_AT, before that step's
checkpoint (0: never). Rank 0 appends "attempt start_step" to OUT/attempts.txt as each
attempt begins training and writes OUT/final.pt (the parameters) at the end."""

import os
import signal
import sys

import torch

from longstraw.parallel.launch import init_distributed, restart_count


def main() -> None:
    out, kill_at = sys.argv[1], int(sys.argv[2])
    rank, _ = init_distributed()  # before GRPOConfig: accelerate reuses this group
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    import trl

    from tests.integrations import trl_worker as worker

    class Kill(trl.trainer.grpo_trainer.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after a checkpoint was loaded
            if rank == 0:
                with open(os.path.join(out, "attempts.txt"), "a") as f:
                    f.write(f"{restart_count()} {state.global_step}\n")  # attempt, the step it starts from

        def on_step_end(self, args, state, control, **kwargs):  # the Trainer saves after this
            if restart_count() == 0 and rank == 1 and state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = worker.make_trainer("detached", out, data_groups=2, context=1, prompts_per_group=1, steps=3,
                                  settings=worker.CHECKPOINTED, callbacks=[Kill()])
    trainer.train(resume_from_checkpoint=True)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(params, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main()
