package main

// Server-side tables for `kubectl get`: a few useful columns for pods and
// nodes, the default NAME/CREATED AT for everything else.

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/duration"
	"k8s.io/apiserver/pkg/registry/rest"
)

type table struct {
	columns []metav1.TableColumnDefinition
	row     func(obj runtime.Object) []interface{}
}

func newTable(def *resourceDef) rest.TableConvertor {
	switch def.resource {
	case "pods":
		return table{
			columns: cols("Name", "Status", "Node", "Age"),
			row: func(obj runtime.Object) []interface{} {
				p := obj.(*corev1.Pod)
				phase := string(p.Status.Phase)
				if p.DeletionTimestamp != nil {
					phase = "Terminating"
				}
				return []interface{}{p.Name, phase, p.Spec.NodeName, age(p.CreationTimestamp)}
			},
		}
	case "nodes":
		return table{
			columns: cols("Name", "Status", "CPU", "Memory", "Age"),
			row: func(obj runtime.Object) []interface{} {
				n := obj.(*corev1.Node)
				status := "Unknown"
				for _, c := range n.Status.Conditions {
					if c.Type == corev1.NodeReady {
						status = map[corev1.ConditionStatus]string{corev1.ConditionTrue: "Ready", corev1.ConditionFalse: "NotReady"}[c.Status]
					}
				}
				if n.Spec.Unschedulable {
					status += ",SchedulingDisabled"
				}
				return []interface{}{n.Name, status, n.Status.Allocatable.Cpu().String(),
					n.Status.Allocatable.Memory().String(), age(n.CreationTimestamp)}
			},
		}
	}
	return rest.NewDefaultTableConvertor(schema.GroupResource{Group: def.gv.Group, Resource: def.resource})
}

func cols(names ...string) []metav1.TableColumnDefinition {
	var out []metav1.TableColumnDefinition
	for _, n := range names {
		c := metav1.TableColumnDefinition{Name: n, Type: "string"}
		if n == "Name" {
			c.Format = "name"
		}
		out = append(out, c)
	}
	return out
}

func age(t metav1.Time) string {
	if t.IsZero() {
		return "<unknown>"
	}
	return duration.HumanDuration(metav1.Now().Sub(t.Time))
}

func (t table) ConvertToTable(ctx context.Context, obj runtime.Object, opts runtime.Object) (*metav1.Table, error) {
	out := &metav1.Table{ColumnDefinitions: t.columns}
	add := func(o runtime.Object) error {
		out.Rows = append(out.Rows, metav1.TableRow{Cells: t.row(o), Object: runtime.RawExtension{Object: o}})
		return nil
	}
	if meta.IsListType(obj) {
		if err := meta.EachListItem(obj, add); err != nil {
			return nil, err
		}
		if l, err := meta.ListAccessor(obj); err == nil {
			out.ResourceVersion = l.GetResourceVersion()
			out.Continue = l.GetContinue()
			out.RemainingItemCount = l.GetRemainingItemCount()
		}
	} else {
		if err := add(obj); err != nil {
			return nil, err
		}
		if m, err := meta.Accessor(obj); err == nil {
			out.ResourceVersion = m.GetResourceVersion()
		}
	}
	if to, ok := opts.(*metav1.TableOptions); ok && to.NoHeaders {
		out.ColumnDefinitions = nil
	}
	return out, nil
}
