use hybridgen_dsl::*;
fn main() {
    let mut a = std::env::args().skip(1);
    let preset = a.next().unwrap();
    let pattern = a.next();
    let dp: usize = a.next().map(|s| s.parse().unwrap()).unwrap_or(1);
    let ep: usize = a.next().map(|s| s.parse().unwrap()).unwrap_or(1);
    let mut m = ModelConfig::preset(&preset).unwrap();
    if let Some(p) = pattern { if !p.is_empty() { m.pattern = p; } }
    let opts = PlanOptions { layout: ParallelLayout::new(dp, ep), ..Default::default() };
    match Plan::new(&m, &opts) {
        Ok(p) => {
            println!("total {} active {} phys {} logical {} units {} buckets {}", p.total_params, p.active_params, p.layers.len(), p.logical_layers.len(), p.units.len(), p.buckets.len());
            for u in &p.units { println!("unit {} {:?} layers {:?} buckets {:?}", u.name, u.shape, u.layers, u.buckets); }
            for b in &p.buckets { println!("bucket {} unit {:?} expert {} numel {} end {} padded {} shard {} meg {:?}", b.id, b.unit, b.expert, b.numel, b.end, b.padded_numel(), b.shard_numel(), b.megatron_padded_numel()); }
            for n in &p.schedule.nodes { println!("node {} {:?}", n.name, hybridgen_dsl::plan::Slot::ALL.iter().map(|s| n.ops(*s)).collect::<Vec<_>>()); }
            println!("{:?}", p.memory);
        }
        Err(d) => println!("{d}"),
    }
}
