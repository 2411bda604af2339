"""What the optimizers make of each parameter's label, for the tests that show an edit keeps every other treatment."""
import train_gpt


def optimizer_plan(model, world_size: int, tg=train_gpt) -> dict:
    """{parameter name: (optimizer group, how its update is normalised)} at `world_size` processes, from the trainer's
    own grouping rules (tg: train_gpt, or an edited copy of it)."""
    names = {id(p): n for n, p in model.named_parameters()}
    plan = {}
    for group, ps in tg.normuon_groups([p for p in model.parameters() if p.treatment != "adam"], world_size)[0]:
        for p in ps:
            stats = "per row" if tg.normuon_reduce_dim(p.treatment, p.shape) == -1 else "per column"
            plan[names[id(p)]] = (f"NorMuon {group}", f"{p.treatment}, second moment {stats}")
    for name, p in model.named_parameters():
        if p.treatment == "adam":
            plan[name] = (f"DistAdam {p.label}", f"adam, {tg.rows_per_rank(p, world_size)} rows per rank")
    return plan
