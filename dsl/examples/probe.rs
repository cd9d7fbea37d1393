fn main() {
    for src in std::env::args().skip(1) {
        match hybridgen_dsl::Pattern::parse(&src) {
            Ok(p) => println!("{src:?} OK {} phys={} log={} mtp={}", p, p.physical_count(), p.logical_count(), p.mtp_depth_count()),
            Err(d) => println!("{src:?} ERR {:?}", d.positions().iter().map(|(c, p)| format!("{c}@{}", p.map(|p| p.to_string()).unwrap_or_default())).collect::<Vec<_>>()),
        }
    }
}
