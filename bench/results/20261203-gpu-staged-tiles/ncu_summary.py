import csv,collections,sys
def num(s): return float(s.replace(',',''))
for a in sys.argv[1:]:
    lines=open(f"ncu-{a}.csv").read().splitlines()
    start=[i for i,l in enumerate(lines) if l.startswith('"ID"')][0]
    rows=list(csv.reader(lines[start:]))
    hdr=rows[0]; units=rows[1]; rows=[r for r in rows[2:] if len(r)==len(hdr)]
    ki=hdr.index("Kernel Name"); ti=hdr.index("gpu__time_duration.sum"); di=hdr.index("dram__bytes_read.sum"); gi=hdr.index("launch__grid_size"); ri=hdr.index("launch__registers_per_thread")
    idx=[i for i,r in enumerate(rows) if r[ki].startswith("bgs_embed") and r[gi]=="1"]
    print(a, "batch-1 embeds at", idx[-5:])
    s0=idx[-1]; e=s0+1
    while e<len(rows) and not rows[e][ki].startswith("bgs_argmax"): e+=1
    step=rows[s0:e+1]
    tot=0; agg=collections.OrderedDict()
    for r in step:
        t=num(r[ti]); d=num(r[di]); k=r[ki].split('(')[0]
        tot+=t
        x=agg.setdefault(k,[0,0,0,r[gi],r[ri]]); x[0]+=1; x[1]+=t; x[2]+=d
    print("kernels",len(step),"sum time us",tot/1e3)
    for k,(n,t,d,g,rg) in agg.items(): print(f"  {k:32s} n={n:3d} total={t/1e3:8.1f}us avg={t/n/1e3:7.2f}us dram/avg={d/n/1e6:8.3f}MB  GB/s={d/t if t else 0:7.0f} grid={g} regs={rg}")
