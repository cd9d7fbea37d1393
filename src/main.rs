fn main() {
    println!("hybridgen: command line in progress");
}
