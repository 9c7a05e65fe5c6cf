use super::findings::Findings;
use super::hosts::parse_hostfile;
use super::mpirun::with_flag;
use std::path::Path;

#[test]
fn hostfiles_and_failures_are_read_as_openmpi_writes_them() {
    let p = Path::new("hosts");
    let h = parse_hostfile("# cluster\nh1 slots=2\nh2\n\nh3 slots=1 # spare\n", p).unwrap();
    assert_eq!(
        h.iter()
            .map(|h| (h.name.as_str(), h.slots))
            .collect::<Vec<_>>(),
        [("h1", 2), ("h2", 1), ("h3", 1)]
    );
    for (bad, want) in [
        ("", "names no host"),
        ("h1 slots=0", "slots=0"),
        ("h1 cores=2", "cores=2"),
        ("h1\nh1", "twice"),
    ] {
        let e = parse_hostfile(bad, p).unwrap_err().to_string();
        assert!(e.contains(want), "{bad}: {e}");
    }
    let hosts = parse_hostfile("h1 slots=2\nh2\nh3\nh4\n", p).unwrap();
    let ranks: Vec<String> = ["h1", "h1", "h2", "h3", "h4"].map(String::from).to_vec();
    let st = |s: &str| Some(format!("rank r host x pid 1\n{s}\n"));
    // A killed host: its rank said nothing more; OpenMPI names it too; a survivor accuses it.
    let out = "  Local host: h4\n  Peer host:  h3\n";
    let statuses = [
        st("terminated"),
        st("terminated"),
        st("error: all_reduce on group world: rank 2 timed out after 10s waiting for rank 3"),
        st("running"),
        None,
    ];
    let judge = |out: &str, statuses: &[Option<String>]| {
        let mut f = Findings::read(out, statuses, &ranks);
        f.settle(&hosts);
        let gone: Vec<String> = f.gone.iter().map(|g| g.0.clone()).collect();
        (gone, f)
    };
    let (gone, f) = judge(out, &statuses);
    assert_eq!(gone, ["h3"], "{f:?}");
    // A partition between h2 and h4: both live and accuse each other; one of them goes.
    let statuses = [
        st("terminated"),
        st("terminated"),
        st("error: send: rank 2 timed out after 10s waiting for rank 4"),
        st("terminated"),
        st("error: recv: rank 4 lost rank 2 (it exited or failed)"),
    ];
    let (gone, f) = judge("", &statuses);
    assert_eq!(gone, ["h4"], "{f:?}");
    // The same partition, with the ranks held up behind it timing out within milliseconds of
    // it: rank 3 waited for rank 4 (itself waiting for rank 2), rank 0 for rank 3. Only the
    // mutual wait is the cut.
    let statuses = [
        st("error: send on group p2p[3,0]: rank 0 timed out after 10s waiting for rank 3"),
        st("terminated"),
        st("error: send on group p2p[4,2]: rank 2 timed out after 10s waiting for rank 4"),
        st("error: all_reduce on group dp[3,4]: rank 3 timed out after 10s waiting for rank 4"),
        st("error: send on group p2p[2,4]: rank 4 timed out after 10s waiting for rank 2"),
    ];
    let (gone, f) = judge("", &statuses);
    assert_eq!(gone, ["h4"], "{f:?}");
    // A failure of the run itself names no host.
    let statuses = [
        st("error: data/x.txt: cannot read"),
        st("terminated"),
        st("terminated"),
        st("terminated"),
        st("terminated"),
    ];
    let (gone, f) = judge("", &statuses);
    assert!(gone.is_empty() && f.other_errors.len() == 1, "{f:?}");
    assert_eq!(
        with_flag(
            &[
                "--layout".into(),
                "dp=4".into(),
                "--steps".into(),
                "9".into()
            ],
            "--layout",
            "auto"
        ),
        ["--layout", "auto", "--steps", "9"]
    );
}
